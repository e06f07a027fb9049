"""Rank, size and group helpers of SMP's "MPI basics" (reference §2.8), read from the topology."""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from smp_compat.errors import DDPNotEnabledError
from smp_compat.globalstate import process_group, state
from smp_compat.topology import Coords

__all__ = [
    "rank", "size", "local_rank", "local_size",
    "pp_rank", "pp_size", "tp_rank", "tp_size", "dp_rank", "dp_size",
    "rdp_rank", "rdp_size", "mp_rank", "mp_size", "num_microbatches",
    "get_pp_group", "get_dp_group", "get_mp_group", "get_tp_group", "get_rdp_group",
    "get_world_process_group", "get_pp_process_group", "get_dp_process_group",
    "get_mp_process_group", "get_tp_process_group", "get_rdp_process_group",
]  # fmt: skip


def _coords(what: str) -> Coords:
    state.require_init(f"smp.{what}()")
    return state.topology.coords(state.rank)


def rank() -> int:
    """Global rank."""
    return _coords("rank").rank


def size() -> int:
    """World size (1 before init, as SMP)."""
    return state.world_size if state.initialized else 1


def local_rank() -> int:
    """Rank within this node."""
    state.require_init("smp.local_rank()")
    return state.launch.local_rank


def local_size() -> int:
    """Number of processes on this node."""
    return state.launch.local_size if state.initialized else 1


def pp_rank() -> int:
    return _coords("pp_rank").pp_rank


def tp_rank() -> int:
    return _coords("tp_rank").tp_rank


def dp_rank() -> int:
    return _coords("dp_rank").dp_rank


def rdp_rank() -> int:
    return _coords("rdp_rank").rdp_rank


def mp_rank() -> int:
    if state.initialized and state.topology.tp_size > 1:
        warnings.warn("smp.mp_rank() with tensor parallelism mixes pp and tp ranks; use smp.pp_rank().", stacklevel=2)
    return _coords("mp_rank").mp_rank


def _size(attr: str) -> int:
    return getattr(state.topology, attr) if state.initialized else 1


def pp_size() -> int:
    return _size("pp_size")


def tp_size() -> int:
    return _size("tp_size")


def dp_size() -> int:
    return _size("dp_size")


def rdp_size() -> int:
    return _size("rdp_size")


def mp_size() -> int:
    return _size("mp_size")


def num_microbatches() -> int:
    """The configured number of microbatches."""
    state.require_init("smp.num_microbatches()")
    return state.cfg.microbatches


def get_pp_group(dp_rank: int | None = None) -> list[int]:
    """Global ranks of a pipeline group, ordered by pp_rank."""
    state.require_init("smp.get_pp_group()")
    return state.topology.get_pp_group(state.rank, dp_rank)


def get_dp_group(pp_rank: int | None = None) -> list[int]:
    state.require_init("smp.get_dp_group()")
    return state.topology.get_dp_group(state.rank, pp_rank)


def get_mp_group(rdp_rank: int | None = None) -> list[int]:
    state.require_init("smp.get_mp_group()")
    return state.topology.get_mp_group(state.rank, rdp_rank)


def get_tp_group(pp_rank: int | None = None, rdp_rank: int | None = None) -> list[int]:
    state.require_init("smp.get_tp_group()")
    return state.topology.get_tp_group(state.rank, pp_rank, rdp_rank)


def get_rdp_group(pp_rank: int | None = None, tp_rank: int | None = None) -> list[int]:
    state.require_init("smp.get_rdp_group()")
    return state.topology.get_rdp_group(state.rank, pp_rank, tp_rank)


def _public_group(axis: str) -> Any:
    state.require_init(f"smp.get_{axis}_process_group()")
    if not state.cfg.ddp:
        raise DDPNotEnabledError(
            f"smp.get_{axis}_process_group() needs torch.distributed process groups, which SMP only creates "
            'with "ddp": True in the config. Add it to the config passed to smp.init.'
        )
    return dist.group.WORLD if axis == "world" else process_group(axis)


def get_world_process_group() -> Any:
    return _public_group("world")


def get_pp_process_group() -> Any:
    return _public_group("pp")


def get_dp_process_group() -> Any:
    return _public_group("dp")


def get_mp_process_group() -> Any:
    return _public_group("mp")


def get_tp_process_group() -> Any:
    return _public_group("tp")


def get_rdp_process_group() -> Any:
    return _public_group("rdp")
