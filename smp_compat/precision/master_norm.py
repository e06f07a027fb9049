"""``clip_master_grads``' global norm: every gradient once, whatever the layout, and the same bits sharded or not.

Each parameter contributes ``|g|^p`` of its fp32 master gradient. A tensor-parallel shard is a different
slice on every tp rank, so the tp group's contributions add up; a replicated parameter is on every tp rank
and counts ``1/tp`` per rank (once in all). With ``shard_optimizer_state`` a rank has masters for its share
only: the per-parameter terms are first completed over the rdp group, where exactly one rank fills each term
(adding zeros is exact), so the terms, their sum and the norm are bitwise those of the unsharded run, and the
clipped steps stay bitwise equal too. Then the pipeline x tp group (mp) sums, as without sharding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from smp_compat.globalstate import process_group, state

__all__ = ["global_norm"]


def global_norm(
    pairs: Sequence[tuple[torch.nn.Parameter, torch.nn.Parameter]],
    local_params: Sequence[torch.nn.Parameter],
    norm_type: float,
    sharded: bool,
) -> float:
    """Norm of the master gradients of ``pairs`` (model parameter, master) over the whole model.

    ``local_params``: every parameter this rank holds, in a fixed order shared by its rdp group (the
    index of each term); a master whose parameter is not among them still counts, at the end.
    """
    with_grads = [(p, m.grad) for p, m in pairs if m.grad is not None]
    if math.isinf(norm_type):
        return _max_norm([g for _, g in with_grads], sharded)
    index = {id(p): i for i, p in enumerate(local_params)}
    extra = [p for p, _ in with_grads if id(p) not in index]
    for p in extra:
        index[id(p)] = len(index)
    terms = torch.zeros(len(index), dtype=torch.float32, device=state.device)
    weights = torch.ones(len(index), dtype=torch.float32, device=state.device)
    tp = state.topology.tp_size if state.initialized else 1
    for p, g in with_grads:
        terms[index[id(p)]] = g.float().norm(norm_type) ** norm_type
    if tp > 1:
        for p, i in ((p, index[id(p)]) for p in (*local_params, *extra)):
            if not hasattr(p, "_smp_tp_dim"):
                weights[i] = 1.0 / tp
    if sharded and state.initialized and state.topology.rdp_size > 1:
        dist.all_reduce(terms, op=dist.ReduceOp.SUM, group=process_group("rdp"))
    total = (terms * weights).sum()
    if state.initialized and state.topology.mp_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group("mp"))
    return float(total.item() ** (1.0 / norm_type))


def _max_norm(grads: list[torch.Tensor], sharded: bool) -> float:
    """The infinity norm: a maximum is exact in any order, so every rank's share simply joins in."""
    local = max((g.abs().max().float() for g in grads), default=torch.zeros(())).to(state.device)
    if not state.initialized:
        return float(local.item())
    topo = state.topology
    if sharded and topo.dp_size > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=process_group("world"))
    elif topo.mp_size > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=process_group("mp"))
    return float(local.item())
