"""Python objects across the pipeline group, for state dicts: all-gathered, or gathered to pp_rank 0 only
(point to point, so the other ranks need not hold every stage's entries at once)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from smp_compat.comm import all_gather_objects, object_device, object_to_tensor, tensor_to_object
from smp_compat.globalstate import process_group, state

__all__ = ["allgather_pp", "gather", "my_pp_rank"]

_P2P_TAG = 0x5D1C


def _pp_members() -> list[int]:
    """Global ranks of this rank's pipeline group, in pp_rank order."""
    return state.topology.get_pp_group(state.rank)


def my_pp_rank() -> int:
    return state.topology.coords(state.rank).pp_rank


def allgather_pp(obj: Any) -> list[Any]:
    """Every pipeline rank's ``obj``, indexed by pp_rank."""
    members = _pp_members()
    if len(members) == 1:
        return [obj]
    gathered = all_gather_objects(obj, process_group("pp"), len(members), object_device())
    by_rank = dict(zip(sorted(members), gathered))
    return [by_rank[r] for r in members]


def _gather_pp_root(obj: Any) -> list[Any] | None:
    """Every pipeline rank's ``obj`` on pp_rank 0 (indexed by pp_rank); None elsewhere."""
    members = _pp_members()
    if len(members) == 1:
        return [obj]
    group, device = process_group("pp"), object_device()
    if state.rank != members[0]:
        payload = object_to_tensor(obj, device)
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), members[0], group, _P2P_TAG)
        dist.send(payload, members[0], group, _P2P_TAG)
        return None
    out = [obj]
    for src in members[1:]:
        length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(length, src, group, _P2P_TAG)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        dist.recv(payload, src, group, _P2P_TAG)
        out.append(tensor_to_object(payload))
    return out


def gather(obj: Any, to_root: bool) -> list[Any] | None:
    return _gather_pp_root(obj) if to_root else allgather_pp(obj)
