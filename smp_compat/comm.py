"""SMP's communication helpers on pickled Python objects (reference §2.9).

``smp.broadcast`` is one-sided as in SMP: the sender calls it, receivers call ``smp.recv_from``.
Group ranks follow SMP's order (the topology's), not torch's sorted order.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.errors import SMPConfigError
from smp_compat.serialize import all_gather_objects, object_to_tensor, tensor_to_object
from smp_compat.globalstate import process_group, state

__all__ = [
    "CommGroup", "RankType", "WORLD", "PP_GROUP", "TP_GROUP", "RDP_GROUP", "DP_GROUP", "MP_GROUP",
    "broadcast", "send", "recv_from", "allgather", "gather", "barrier",
    "dp_barrier", "mp_barrier", "pp_barrier", "tp_barrier", "rdp_barrier",
]  # fmt: skip

_OBJECT_TAG = 0x5A17


class CommGroup(enum.IntEnum):
    """Groups addressed by the communication helpers (SMP's code values)."""

    WORLD = 0
    PP_GROUP = 1
    TP_GROUP = 2
    RDP_GROUP = 3
    DP_GROUP = 4
    MP_GROUP = 5


class RankType(enum.IntEnum):
    """Which rank numbering a ``send``/``recv_from`` peer is given in."""

    WORLD_RANK = 0
    PP_RANK = 1
    TP_RANK = 2
    RDP_RANK = 3
    DP_RANK = 4
    MP_RANK = 5


WORLD, PP_GROUP, TP_GROUP, RDP_GROUP, DP_GROUP, MP_GROUP = CommGroup
_AXIS = {0: "world", 1: "pp", 2: "tp", 3: "rdp", 4: "dp", 5: "mp"}


def _axis(group: Any, kind: type[enum.IntEnum]) -> str:
    try:
        return _AXIS[int(kind(group))]
    except (ValueError, TypeError):
        valid = ", ".join(f"smp.{kind.__name__}.{m.name}" for m in kind)
        raise SMPConfigError(f"{group!r} is not a {kind.__name__}; use one of {valid}.") from None


def _members(axis: str) -> list[int]:
    """Global ranks of this rank's group on ``axis``, in SMP group-rank order."""
    state.require_init("smp communication helpers")
    return state.topology.group(axis, state.rank)


def _device() -> torch.device:
    return state.device if state.backend == "nccl" else torch.device("cpu")


def _send_object(obj: Any, dst: int) -> None:
    payload = object_to_tensor(obj, _device())
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=_device()), dst, tag=_OBJECT_TAG)
    dist.send(payload, dst, tag=_OBJECT_TAG)


def _recv_object(src: int) -> Any:
    length = torch.zeros(1, dtype=torch.int64, device=_device())
    dist.recv(length, src, tag=_OBJECT_TAG)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=_device())
    dist.recv(payload, src, tag=_OBJECT_TAG)
    return tensor_to_object(payload)


def broadcast(obj: Any, group: CommGroup | int) -> None:
    """Send ``obj`` to every other member of this rank's ``group``; they call ``recv_from``."""
    for dst in _members(_axis(group, CommGroup)):
        if dst != state.rank:
            _send_object(obj, dst)


def _peer(rank_in_group: int, rank_type: RankType | int) -> int:
    members = _members(_axis(rank_type, RankType))
    if not 0 <= rank_in_group < len(members):
        raise SMPConfigError(
            f"rank {rank_in_group} is out of range for {RankType(rank_type).name} (group of {len(members)})."
        )
    return members[rank_in_group]


def send(obj: Any, dest_rank: int, rank_type: RankType | int) -> None:
    """Send ``obj`` to ``dest_rank``, numbered within the group that ``rank_type`` names."""
    _send_object(obj, _peer(dest_rank, rank_type))


def recv_from(src_rank: int, rank_type: RankType | int) -> Any:
    """Receive an object from a matching ``send`` or ``broadcast``."""
    return _recv_object(_peer(src_rank, rank_type))


def allgather(obj: Any, group: CommGroup | int) -> list[Any]:
    """Every member's ``obj``; entry i came from group rank i."""
    axis = _axis(group, CommGroup)
    members = _members(axis)
    if len(members) == 1:
        return [obj]
    gathered = all_gather_objects(obj, process_group(axis), len(members), _device())
    by_rank = dict(zip(sorted(members), gathered))
    return [by_rank[r] for r in members]


def gather(obj: Any, group: CommGroup | int, rank: int = 0) -> list[Any] | None:
    """Objects of every member on group rank ``rank`` (others get None); built on allgather."""
    axis = _axis(group, CommGroup)
    members = _members(axis)
    if not 0 <= rank < len(members):
        raise SMPConfigError(
            f"smp.gather rank {rank!r} is out of range for {CommGroup(group).name} (group of {len(members)}); "
            f"pass a group rank in 0..{len(members) - 1}."
        )
    everything = allgather(obj, group)
    return everything if state.rank == members[rank] else None


def barrier(group: CommGroup | int = CommGroup.WORLD) -> None:
    """Wait for every member of ``group``."""
    axis = _axis(group, CommGroup)
    if len(_members(axis)) > 1:
        dist.barrier(group=process_group(axis))


def dp_barrier() -> None:
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    barrier(CommGroup.MP_GROUP)


def pp_barrier() -> None:
    barrier(CommGroup.PP_GROUP)


def tp_barrier() -> None:
    barrier(CommGroup.TP_GROUP)


def rdp_barrier() -> None:
    barrier(CommGroup.RDP_GROUP)
