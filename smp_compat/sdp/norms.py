"""Gradient norms over sharded (DTensor) and replicated (plain) gradients, mixed safely.

``torch.nn.utils.clip_grad_norm_`` fails on a mix of DTensor and plain tensors (``_foreach_norm`` got
mixed types), and a DTensor norm over an HSDP mesh must not count the replicas twice. So: each rank
sums its local shards' powers, those sums are all-reduced over the sharding group only (replicas
hold equal shards after the gradient all-reduce), and plain gradients (identical on every rank) are
added once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from smp_compat.sdp.mesh import shard_dim_mesh

__all__ = ["global_grad_norm", "clip_by_norm"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def global_grad_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> float:
    """The norm of all gradients as if unsharded (collective over the sharding group)."""
    grads = list(grads)
    sharded = [_local(g).detach().float() for g in grads if isinstance(g, DTensor)]
    plain = [g.detach().float() for g in grads if not isinstance(g, DTensor)]
    device = (sharded + plain)[0].device if sharded or plain else torch.device("cpu")
    inf = math.isinf(norm_type)
    if inf:
        part = max((g.abs().max() for g in sharded if g.numel()), default=torch.zeros((), device=device))
        part = torch.as_tensor(part, dtype=torch.float32, device=device).clone()
    else:
        part = sum((g.norm(norm_type) ** norm_type for g in sharded if g.numel()), torch.zeros((), device=device))
    group = shard_dim_mesh().get_group()
    dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    if inf:
        rest = max((float(g.abs().max()) for g in plain if g.numel()), default=0.0)
        return max(float(part), rest)
    total = float(part) + sum(float(g.norm(norm_type) ** norm_type) for g in plain if g.numel())
    return total ** (1.0 / norm_type)


def clip_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total: float) -> None:
    """Scale gradients in place so their global norm is at most ``max_norm`` (torch's coefficient)."""
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        with torch.no_grad():
            for g in grads:
                _local(g).mul_(coefficient)
