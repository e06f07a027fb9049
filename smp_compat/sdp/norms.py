"""Gradient norms over sharded (DTensor) and replicated (plain) gradients, mixed safely, without host syncs.

``torch.nn.utils.clip_grad_norm_`` fails on a mix of DTensor and plain tensors (``_foreach_norm`` got
mixed types), and a DTensor norm over an HSDP mesh must not count the replicas twice. So: each rank
sums its local shards' powers, those sums are all-reduced over the sharding group only (replicas
hold equal shards after the gradient all-reduce), and plain gradients (identical on every rank) are
added once. Under tensor parallelism the tp shards' sums are first all-reduced over the tp group (each
tp rank holds other rows), the tp-replicated ones counted once. Everything stays on the device:
reading the norm as a number is the caller's choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from smp_compat.sdp.mesh import shard_dim_mesh

__all__ = ["global_grad_norm", "clip_by_norm"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _partial(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """max |g| (inf norm) or sum |g|^p over ``tensors``, as an fp32 scalar on ``device``."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors, norm_type)])
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def global_grad_norm(
    grads: Iterable[torch.Tensor], norm_type: float = 2.0, tp_grads: Iterable[torch.Tensor] = (), tp_group: Any = None
) -> torch.Tensor:
    """The norm of all gradients as if unsharded, a 0-dim tensor (collective over the sharding group).

    ``tp_grads`` (sharded over the rdp group like the rest) are tensor-parallel shards: their pieces are
    summed over ``tp_group`` too, while ``grads`` are the same on every tp rank and count once.
    """
    grads = [g.detach() for g in grads]
    tp_grads = [_local(g.detach()) for g in tp_grads]
    sharded = [_local(g) for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    device = (sharded + plain + tp_grads)[0].device if grads or tp_grads else torch.device("cpu")
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    if tp_group is None:  # tp = 1: a shard is the whole tensor
        sharded, tp_grads = sharded + tp_grads, []
    part = _partial(sharded, norm_type, device)
    if tp_group is not None:  # every tp rank takes part, with or without shards
        tp_part = _partial(tp_grads, norm_type, device)
        dist.all_reduce(tp_part, op=op, group=tp_group)
        part = torch.maximum(part, tp_part) if inf else part + tp_part
    dist.all_reduce(part, op=op, group=shard_dim_mesh().get_group())
    rest = _partial(plain, norm_type, device)
    if inf:
        return torch.maximum(part, rest)
    return (part + rest).pow(1.0 / norm_type)


def clip_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale gradients in place so their global norm is at most ``max_norm`` (torch's coefficient)."""
    locals_ = [_local(g) for g in grads]
    if locals_:
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(locals_, coefficient.to(locals_[0].device))
