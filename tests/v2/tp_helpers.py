"""Tiny Hugging Face models of the families ``tsm.transform`` supports, and the plain one-process training the
tensor-parallel runs must equal (fp32, AdamW, the same batches)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import transformers

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH, STEPS = 64, 32, 2, 4, 16, 2, 5

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip
"""Llama 3.1's scaling: positions beyond 16 take the scaled frequencies, so the test sequences use both."""


def config(family: str) -> Any:
    """The tiny config of ``family`` (llama: GQA 4 heads over 2 kv heads; llama3: plus llama3 rope scaling),
    untied as AWS's scripts build them."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  max_position_embeddings=4 * SEQ, tie_word_embeddings=False, use_cache=False)  # fmt: skip
    if family in ("llama", "llama3"):
        rope = {"rope_scaling": LLAMA3_ROPE} if family == "llama3" else {}
        return transformers.LlamaConfig(intermediate_size=2 * HIDDEN, num_key_value_heads=2, **rope, **common)
    if family == "mistral":
        return transformers.MistralConfig(intermediate_size=2 * HIDDEN, num_key_value_heads=2, sliding_window=8,
                                          **common)  # fmt: skip
    if family == "gpt_neox":
        # rotary on every feature: an unrotated key bias has a zero true gradient, whose float noise AdamW amplifies
        return transformers.GPTNeoXConfig(intermediate_size=4 * HIDDEN, rotary_pct=1.0, hidden_act="gelu",
                                          hidden_dropout=0.0, attention_dropout=0.0, **common)  # fmt: skip
    raise ValueError(family)


def build(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(family))


def batches(steps: int = STEPS, batch: int = BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, steps: list[torch.Tensor]) -> list[float]:
    """AdamW steps of Hugging Face's own loss; returns the losses."""
    optimizer = adamw(model.parameters())
    losses = []
    for ids in steps:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered (collective over its mesh)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = value.detach().clone()
    return out


def reference(family: str, steps: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: losses and final weights."""
    model = build(family)
    losses = train(model, steps)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
