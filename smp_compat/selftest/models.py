"""The tiny models and data the checks train: small enough that a check takes about a second on one CPU core.

Each ``Recipe`` says how to build the model (seeded, so every rank and the one-process reference build the
same one), the global batches, the loss and the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Recipe", "gpt2_recipe", "llama_recipe", "lm_recipe", "mlp_recipe"]

WIDTH, HIDDEN = 4, 8
VOCAB, LM_HIDDEN, HEADS, SEQ = 32, 16, 4, 6
STEPS = 3


@dataclass(frozen=True)
class Recipe:
    """One small training job: ``build()`` is called under ``torch.manual_seed(0)``; ``batches(n)`` gives
    ``STEPS`` global batches of ``n`` samples, each a tuple of tensors split along dim 0; ``loss(model, *batch)``."""

    build: Callable[[], nn.Module]
    batches: Callable[[int], list[tuple[torch.Tensor, ...]]]
    loss: Callable[..., torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    steps: int = STEPS


class _Out(nn.Module):
    """The last layer, with a constant buffer, so buffers travel through partitioning and checkpoints too."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, WIDTH)
        self.register_buffer("shift", torch.full((WIDTH,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.shift


class Mlp(nn.Module):
    """``a`` (in), ``depth - 2`` hidden blocks ``b``, ``c`` (out): enough modules for ``depth`` pipeline stages."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh())
        self.b = nn.Sequential(*(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(max(depth - 2, 1))))
        self.c = _Out()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def _regression_batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)) for _ in range(STEPS)]


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y.float())


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05)


def mlp_recipe(depth: int = 3, optimizer: Callable[[Any], torch.optim.Optimizer] = sgd) -> Recipe:
    """Regression with an ``Mlp``: the model of the data, pipeline, precision and checkpoint checks."""
    return Recipe(lambda: Mlp(depth), _regression_batches, _mse, optimizer)


class TinyLM(nn.Module):
    """Embedding -> smp.nn.DistributedTransformer (pre-LN, causal) -> LayerNorm -> DistributedLinear -> head.

    Built from ``smp.nn`` modules: whole before ``smp.init`` (the reference), split over the tp group after.
    """

    def __init__(self, smp_nn: Any, layers: int = 2) -> None:
        super().__init__()
        self.embedding = smp_nn.DistributedEmbedding(VOCAB, LM_HIDDEN)
        self.transformer = smp_nn.DistributedTransformer(
            num_layers=layers, num_attention_heads=HEADS, attention_head_size=LM_HIDDEN // HEADS,
            hidden_size=LM_HIDDEN, intermediate_size=2 * LM_HIDDEN, attention_dropout_prob=0.0,
            hidden_dropout_prob=0.0, causal_mask_size=SEQ, pre_layernorm=True, post_layernorm=False,
            use_normal_initialization=True, initializer_range=0.2)  # fmt: skip
        self.ln = nn.LayerNorm(LM_HIDDEN)
        self.proj = smp_nn.DistributedLinear(LM_HIDDEN, LM_HIDDEN)
        self.head = nn.Linear(LM_HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.transformer((self.embedding(ids), None))
        return self.head(torch.tanh(self.proj(self.ln(h))))


def _token_batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(123)
    return [(torch.randint(0, VOCAB, (n, SEQ), generator=g),) for _ in range(STEPS)]


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _momentum(params: Any) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam would amplify float noise in the attention key bias, whose true gradient is 0
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def lm_recipe(layers: int = 2) -> Recipe:
    """A language model of ``smp.nn`` modules: the tensor-parallel check's model."""
    import smp_compat

    return Recipe(lambda: TinyLM(smp_compat.nn, layers), _token_batches, _lm_loss, _momentum)


def _gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()  # its notes on this tiny config's token ids are not ours to show
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=LM_HIDDEN, n_layer=2, n_head=HEADS,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                     eos_token_id=0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def gpt2_recipe() -> Recipe:
    """A two-layer Hugging Face GPT-2, swapped for smp.nn's DistributedTransformer under tensor parallelism."""
    return Recipe(_gpt2, _token_batches, _hf_loss, _momentum)


def _llama() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=LM_HIDDEN, intermediate_size=2 * LM_HIDDEN,
                                      num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                      max_position_embeddings=SEQ, tie_word_embeddings=False, use_cache=False,
                                      attn_implementation="sdpa")  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def llama_recipe() -> Recipe:
    """A two-layer Hugging Face Llama (grouped-query attention): the SMP v2 checks' model, which tsm.transform
    splits over the tp group and the FSDP façade shards."""
    return Recipe(_llama, _token_batches, _hf_loss, _momentum)


def _mixtral() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=LM_HIDDEN, intermediate_size=2 * LM_HIDDEN,
                                        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False, use_cache=False,
                                        attn_implementation="sdpa")  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def mixtral_recipe() -> Recipe:
    """A two-layer Hugging Face Mixtral (4 experts, top 2): the expert-parallel check's model. Its loss is the
    language-model loss alone (stock Mixtral adds no router loss unless ``output_router_logits``)."""
    return Recipe(_mixtral, _token_batches, _hf_loss, _momentum)
