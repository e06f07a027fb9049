"""Tiny models built from smp.nn modules, and the plain single-process reference run for the tp tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, SEQ, GLOBAL_BATCH, STEPS = 32, 16, 4, 6, 8, 3


class TinySmpLM(nn.Module):
    """Embedding -> DistributedTransformer (pre-LN, causal) -> LayerNorm -> DistributedLinear -> plain head."""

    def __init__(self, smp_nn: Any, post_layernorm: bool = False, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.embedding = smp_nn.DistributedEmbedding(VOCAB, HIDDEN)
        self.transformer = smp_nn.DistributedTransformer(
            num_layers=2, num_attention_heads=HEADS, attention_head_size=HIDDEN // HEADS, hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN, attention_dropout_prob=attention_dropout, hidden_dropout_prob=0.0,
            causal_mask_size=SEQ, pre_layernorm=not post_layernorm, post_layernorm=post_layernorm,
            use_normal_initialization=True, initializer_range=0.2)  # fmt: skip
        self.ln = nn.LayerNorm(HIDDEN)
        self.proj = smp_nn.DistributedLinear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embedding(ids)
        h, _ = self.transformer((h, mask))
        return self.head(torch.tanh(self.proj(self.ln(h))))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def padded_inputs(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Right padding on some samples and per-sample position ids, both chosen by content (the same on any split)."""
    mask = torch.ones_like(ids)
    mask[ids[:, 0] % 3 == 0, -2:] = 0
    positions = torch.arange(ids.shape[1]) * (1 + ids[:, :1] % 3)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}


def hf_padded_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's own loss on ``padded_inputs``."""
    return model(**padded_inputs(ids), labels=ids).loss


def adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def batches(steps: int = STEPS, global_batch: int = GLOBAL_BATCH) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, VOCAB, (global_batch, SEQ), generator=g) for _ in range(steps)]


def reference(
    build: Any, steps: int = STEPS, loss_fn: Any = None, make_opt: Any = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the global batch (no smp.init: smp.nn modules are whole); ``make_opt(params)`` replaces
    the default SGD."""
    torch.manual_seed(0)
    model = build()
    # SGD by default: Adam would amplify float noise in the key bias, whose true gradient is 0
    opt = make_opt(model.parameters()) if make_opt else torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for ids in batches(steps):
        loss = (loss_fn or (lambda m, x: lm_loss(m(x), x)))(model, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(smp: Any, model: Any, opt: Any, loss_of: Callable[[Any, torch.Tensor], torch.Tensor]) -> list[float]:
    """The tp jobs' loop over ``batches()``: ``@smp.step`` around ``loss_of(model, ids)``, this rank's samples,
    the loss averaged over microbatches per step."""

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in batches():
        opt.zero_grad()
        losses.append(train_step(my_samples(smp, ids)).reduce_mean().item())
        opt.step()
    return losses


def my_samples(smp: Any, ids: torch.Tensor) -> torch.Tensor:
    """This rank's part of the global batch: by dp rank, or by rdp rank with prescaled_batch."""
    if smp.state.cfg.prescaled_batch:
        index, count = smp.rdp_rank(), smp.rdp_size()
    else:
        index, count = smp.dp_rank(), smp.dp_size()
    per = ids.shape[0] // count
    return ids[index * per : (index + 1) * per]
