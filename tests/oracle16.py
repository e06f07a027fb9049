"""The 16-bit oracle: what SMP's ``fp16`` / ``bf16`` semantics prescribe, in one process on the global batch.

SMP trained a model built in 16 bits (``smp.model_creation(dtype=...)``) with fp32 master weights and fp32
optimizer state: the forward and backward run in 16 bits (inputs cast to 16 bits, outputs back to fp32, so
the loss is fp32), the 16-bit gradients are copied into the fp32 masters and unscaled, a non-finite one
skips the step on every rank and lowers the fp16 loss scale (SMP's dynamic-scaler rules, ``LossScaler``),
the global norm is clipped on the fp32 master gradients, the optimizer steps the masters, and the
16-bit weights are the masters rounded. Every 16-bit parallel configuration is compared with this at a
16-bit tolerance (``TOLERANCE``), on the losses of every step and the final weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from smp_compat.precision.fp16 import LossScaler

__all__ = ["Oracle16", "build_16bit", "train_16bit", "TOLERANCE"]

# (rtol, atol): two units in the last place of a 16-bit weight (docs/differences.md, "Combination-matrix tolerances")
TOLERANCE = {
    dtype: (2 * torch.finfo(dtype).eps, torch.finfo(dtype).eps / 4) for dtype in (torch.float16, torch.bfloat16)
}


@dataclass
class Oracle16:
    """What the oracle run produced: per-step losses and norms (-1 on a skipped step), weights, scales."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    scales: list[float | None] = field(default_factory=list)
    masters: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # the 16-bit model's own parameters


def build_16bit(make: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """``make()`` with ``dtype`` as the default dtype, as ``smp.model_creation(dtype=...)`` builds it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return make()
    finally:
        torch.set_default_dtype(previous)


def _to(dtype: torch.dtype, value: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def train_16bit(
    model: nn.Module,
    batches: Sequence[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    dtype: torch.dtype,
    scaler: LossScaler | None = None,
    clip: float = 0.0,
) -> Oracle16:
    """Train the 16-bit ``model`` on ``batches`` as SMP's 16-bit recipe (module doc); ``clip`` 0: no clipping.

    ``loss_fn(model, batch)`` runs the forward; floating tensors in ``batch`` are cast to ``dtype`` first and
    the loss is taken in fp32 by the caller (``.float()`` on the output), as ``DistributedModel`` does.
    """
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().float().clone()) for p in params]
    opt = make_optimizer(masters)
    out = Oracle16()
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, _to(dtype, batch)).float()
        scale = scaler.scale if scaler is not None else 1.0
        (loss * scale).backward()
        out.losses.append(loss.item())
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.detach().float() / scale
        overflow = any(not torch.isfinite(m.grad).all() for m in masters if m.grad is not None)
        out.scales.append(scale if scaler is not None else None)
        if scaler is not None:
            scaler.update(overflow)
        if overflow:
            out.norms.append(-1.0)
            continue
        grads = [m for m in masters if m.grad is not None]
        out.norms.append(float(torch.nn.utils.clip_grad_norm_(grads, clip if clip > 0 else float("inf"))))
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    out.masters = {n: m.detach().clone() for n, m in zip(names, masters)}
    out.weights = {n: p.detach().clone() for n, p in zip(names, params)}
    return out
