"""Data-parallel gradient reduction: average local gradients over a process group, in buckets.

Microbatch averaging is not done here: ``model.backward`` scales each microbatch's seed gradient
by 1/microbatches, so accumulated gradients are never divided twice (the bug torchtitan hit with
outer accumulation). This module only averages over data-parallel replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["average_gradients", "broadcast_tensors"]


def _buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices grouped by dtype/device, each group at most ``cap_bytes`` (a tensor larger than the cap alone)."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[int]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key not in groups or sizes[key] + nbytes > cap_bytes:
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(i)
        sizes[key] += nbytes
    return [bucket for buckets in groups.values() for bucket in buckets if bucket]


def average_gradients(
    params: Sequence[torch.nn.Parameter], group: Any, group_size: int, bucket_cap_mb: float = 100.0
) -> None:
    """Average ``p.grad`` over ``group`` for every parameter; all ranks of the group must pass the same list.

    A parameter whose gradient is None on every rank stays None (as in single-process PyTorch);
    one that has a gradient on some ranks only is treated as zero elsewhere.
    """
    if group_size <= 1 or not params:
        return
    has_grad = _agree_on_grads(params, group)
    live = [p for p, flag in zip(params, has_grad) if flag]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in live]
    cap = int(bucket_cap_mb * 1024 * 1024)
    pending = []
    for bucket in _buckets(grads, cap):
        flat = _flatten_dense_tensors([grads[i] for i in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        flat.div_(group_size)
        for i, synced in zip(bucket, _unflatten_dense_tensors(flat, [grads[i] for i in bucket])):
            grads[i].copy_(synced)


def _agree_on_grads(params: Sequence[torch.nn.Parameter], group: Any) -> list[bool]:
    """Which parameters have a gradient on at least one rank of the group."""
    device = params[0].device
    flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(flags, group=group)
    return [bool(f) for f in flags.tolist()]


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group: Any, group_size: int) -> None:
    """Copy ``tensors`` from global rank ``src`` to every rank of ``group`` (parameters/buffers at start)."""
    if group_size <= 1 or not tensors:
        return
    for bucket in _buckets(tensors, 64 * 1024 * 1024):
        chosen = [tensors[i] for i in bucket]
        flat = _flatten_dense_tensors([t.detach() for t in chosen])
        dist.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for t, synced in zip(chosen, _unflatten_dense_tensors(flat, chosen)):
                t.copy_(synced)
