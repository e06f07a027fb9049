"""Gradient reduction and replica sync under tensor parallelism (SMP's hybrid rule).

Tensor-parallel shards ("scaled-batch" parameters) already hold the gradient of their tp group's whole
batch, so they are summed over the RDP group only and divided by ``dp_size`` (default batch: the tp
group's losses are each a mean over their own samples) or by ``rdp_size`` (prescaled batch: the tp group
shares one batch). Every other parameter is averaged over the DP group, as without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from smp_compat.stepping import grads
from smp_compat.globalstate import process_group, state
from smp_compat.nn.module import is_shard

__all__ = ["reduce_gradients", "sync_replicas"]


def reduce_gradients(params: Sequence[torch.nn.Parameter], bucket_cap_mb: float) -> None:
    topo = state.topology
    shards = [p for p in params if is_shard(p)]
    others = [p for p in params if not is_shard(p)]
    grads.average_gradients(others, process_group("dp"), topo.dp_size, bucket_cap_mb)
    if not shards:
        return
    grads.average_gradients(shards, process_group("rdp"), topo.rdp_size, bucket_cap_mb)
    if topo.tp_size > 1 and not state.cfg.prescaled_batch:
        for p in shards:
            if p.grad is not None:
                p.grad.div_(topo.tp_size)


def sync_replicas(tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast shards from rdp rank 0 (each tp rank keeps its own shard) and the rest from dp rank 0."""
    topo = state.topology
    shards = [t for t in tensors if is_shard(t)]
    others = [t for t in tensors if not is_shard(t)]
    grads.broadcast_tensors(others, topo.get_dp_group(state.rank)[0], process_group("dp"), topo.dp_size)
    grads.broadcast_tensors(shards, topo.get_rdp_group(state.rank)[0], process_group("rdp"), topo.rdp_size)
