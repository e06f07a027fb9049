"""SMP's communication helpers on pickled Python objects (reference §2.9).

``smp.broadcast`` is one-sided as in SMP: the sender calls it, receivers call ``smp.recv_from``.
Group ranks follow SMP's order (the topology's), not torch's sorted order. The object-to-tensor helpers
at the end (no numpy, which torch's own object collectives need) also carry checkpoints' and the pipeline's
metadata.
"""

from __future__ import annotations

import ctypes
import enum
import pickle
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.errors import SMPConfigError
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


def object_device() -> torch.device:
    """Where pickled objects travel as bytes: the rank's GPU under NCCL (it sends device tensors only), else CPU."""
    return state.device if state.backend == "nccl" else torch.device("cpu")


def _send_object(obj: Any, dst: int) -> None:
    payload = object_to_tensor(obj, object_device())
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=object_device()), dst, tag=_OBJECT_TAG)
    dist.send(payload, dst, tag=_OBJECT_TAG)


def _recv_object(src: int) -> Any:
    length = torch.zeros(1, dtype=torch.int64, device=object_device())
    dist.recv(length, src, tag=_OBJECT_TAG)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=object_device())
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
    gathered = all_gather_objects(obj, process_group(axis), len(members), object_device())
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


# ---------------------------------------------------------------- Python objects as byte tensors


def object_to_tensor(obj: Any, device: torch.device | None = None) -> torch.Tensor:
    """Pickle ``obj`` into a 1-D uint8 tensor on ``device``."""
    tensor = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    return tensor if device is None or device.type == "cpu" else tensor.to(device)


def tensor_to_object(tensor: torch.Tensor, length: int | None = None) -> Any:
    """Inverse of ``object_to_tensor``; ``length`` trims padding."""
    data = tensor.detach().to("cpu").contiguous()
    n = data.numel() if length is None else length
    return pickle.loads(ctypes.string_at(data.data_ptr(), n))


def all_gather_objects(obj: Any, group: Any, group_size: int, device: torch.device) -> list[Any]:
    """Every member's ``obj`` in torch's (sorted global rank) order of ``group``."""
    payload = object_to_tensor(obj, device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(group_size)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    sizes = [int(t.item()) for t in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    chunks = [torch.empty_like(padded) for _ in range(group_size)]
    dist.all_gather(chunks, padded, group=group)
    return [tensor_to_object(c, n) for c, n in zip(chunks, sizes)]


def broadcast_object(obj: Any, src: int, group: Any = None, device: torch.device | None = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (the world by default)."""
    device = device or _default_device()
    is_src = dist.get_rank() == src
    payload = object_to_tensor(obj, device) if is_src else None
    length = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if not is_src:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return obj if is_src else tensor_to_object(payload)


def _default_device() -> torch.device:
    backend = dist.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
