"""``torch.sagemaker.grad_norm.clip_grad_norm_``: clip by the norm of the whole model's gradient.

Under FSDP2 and tensor parallelism each rank holds pieces of each gradient (DTensors). The norm must be
that of the full gradient, as one-process ``torch.nn.utils.clip_grad_norm_`` computes it: each distinct
piece is counted once — a rank whose coordinate on a replicated mesh dimension is not 0 contributes
nothing, and copies of a mesh that does not span the job are divided out — and one all-reduce over the
job sums the p-th powers (a max for the infinity norm). Plain tensors are taken as identical on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from smp_compat.errors import SMPConfigError

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    model: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients in place so their global norm is at most ``max_norm``; return the norm before it."""
    params = model.parameters() if isinstance(model, nn.Module) else model
    grads = [p.grad for p in params if p.grad is not None]
    p = float(norm_type)
    if p <= 0 and not math.isinf(p):
        raise SMPConfigError(f"clip_grad_norm_(norm_type={norm_type}): use a positive norm or inf.")
    world = dist.get_world_size() if dist.is_initialized() else 1
    pieces = [_local_piece(g, world) for g in grads]
    total = _global_norm(pieces, p, grads[0].device if grads else torch.device("cpu"))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(  # torch's own error for error_if_nonfinite
            f"The total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if locals_:
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    return total


def _local_piece(g: torch.Tensor, world: int) -> tuple[torch.Tensor, float]:
    """This rank's share of ``g`` and the weight its contribution gets (0: a duplicate counted elsewhere)."""
    if not isinstance(g, DTensor):
        return g, 1.0 if not dist.is_initialized() or dist.get_rank() == 0 else 0.0
    if any(isinstance(pl, Partial) for pl in g.placements):
        g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
    mesh = g.device_mesh
    for dim, pl in enumerate(g.placements):
        if isinstance(pl, Replicate) and mesh.get_local_rank(dim) != 0:
            return g.to_local(), 0.0
    return g.to_local(), mesh.size() / world


def _global_norm(pieces: list[tuple[torch.Tensor, float]], p: float, device: torch.device) -> torch.Tensor:
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for t, weight in pieces:
        if weight == 0.0 or t.numel() == 0:
            continue
        n = torch.linalg.vector_norm(t, p).float().to(device)
        acc = torch.maximum(acc, n) if math.isinf(p) else acc + weight * n**p
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
    return acc if math.isinf(p) else acc ** (1.0 / p)
