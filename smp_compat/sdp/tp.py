"""Tensor parallelism inside sharded data parallelism (SMP 1.15: sdp over the reduced-data-parallel group).

Each tp rank's ``smp.nn`` shard parameters are local slices already; FSDP2 shards every parameter of
the tp rank's model over its rdp group (mesh.py), so a tp-shard parameter's rows live 1/(tp x sdp) per
rank. FSDP's reduce-scatter averages over rdp only, which leaves the tp group's part of SMP's rule
(nn/grads.py) to this module, applied to the sharded gradients before clipping and the step:

* tp-replicated parameters: averaged over the tp group too (all-reduce of the local shards: the ranks
  of a tp group hold the same rows of their copies, since they sit at the same sharding coordinate);
* tp-shard ("scaled-batch") parameters: divided by ``tp`` in the default batch mode (their gradient
  already covers the tp group's whole batch), left alone with ``prescaled_batch``.

FSDP2 builds new parameter objects, so the tp marks (``_smp_tp_dim``, ``_smp_tp_blocks``) are copied
onto them here, keeping ``is_distributed_parameter`` and the tp gathers of state dicts working.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from smp_compat.globalstate import process_group, state

__all__ = ["tp_size", "is_tp_shard", "tp_marks", "restore_tp_marks", "reduce_tp_gradients", "split_tp"]

MARKS = ("_smp_tp_dim", "_smp_tp_blocks")


def tp_size() -> int:
    return state.topology.tp_size if state.initialized else 1


def is_tp_shard(p: torch.Tensor) -> bool:
    """A tensor-parallel shard (``smp.nn``'s mark; the same test as ``nn.module.is_shard``)."""
    return hasattr(p, "_smp_tp_dim")


def tp_marks(root: nn.Module) -> dict[str, dict[str, Any]]:
    """``{parameter name: its tp marks}`` for every shard parameter (taken before ``fully_shard``)."""
    return {
        name: {m: getattr(p, m) for m in MARKS if hasattr(p, m)}
        for name, p in root.named_parameters(remove_duplicate=False)
        if is_tp_shard(p)
    }


def restore_tp_marks(root: nn.Module, marks: dict[str, dict[str, Any]]) -> None:
    """Put the marks back on the parameters FSDP2 substituted (sharded DTensor parameters)."""
    for name, p in root.named_parameters(remove_duplicate=False):
        for key, value in marks.get(name, {}).items():
            setattr(p, key, value)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # in place: the DTensor's own storage


def split_tp(params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(gradients of tp-replicated parameters, gradients of tp shards), Nones left out."""
    replicated, shards = [], []
    for p in params:
        if p.grad is not None:
            (shards if is_tp_shard(p) else replicated).append(p.grad)
    return replicated, shards


def reduce_tp_gradients(params: Iterable[torch.Tensor]) -> None:
    """Complete SMP's gradient rule over the tp group after FSDP's rdp reduce-scatter (see the module doc)."""
    n = tp_size()
    if n == 1:
        return
    replicated, shards = split_tp(params)
    locals_ = [_local(g) for g in replicated if _local(g).numel()]
    if locals_:
        flat = _flatten_dense_tensors(locals_)
        dist.all_reduce(flat, group=process_group("tp"))
        flat.div_(n)
        with torch.no_grad():
            for g, reduced in zip(locals_, _unflatten_dense_tensors(flat, locals_)):
                g.copy_(reduced)
    if shards and not state.cfg.prescaled_batch:
        torch._foreach_div_([_local(g) for g in shards], float(n))
