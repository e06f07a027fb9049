"""``tsm.init(config)``: resolve the config, join (or start) the process group, build the device mesh and fill
``tsm.state``.

AWS's scripts call ``dist.init_process_group`` before ``tsm.init()``; init then uses that group. Called first,
init starts one itself from torchrun's, Slurm's or Open MPI's variables (smp_compat.launch), NCCL when each
local process has a GPU, else gloo.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from smp_compat.errors import SMPConfigError
from smp_compat.launch import detect_launch
from smp_compat.v2.config import resolve_v2_config
from smp_compat.v2.layout import DIMS, Layout, resolve_shard_degree
from smp_compat.v2.rng import MODEL_PARALLEL_RNG, RNGStatesTracker
from smp_compat.v2.standins.attention import install_sdpa_fallback
from smp_compat.v2.standins.real_te import guard_real_fp8_autocast
from smp_compat.v2.state import state

__all__ = ["build_mesh", "init", "is_initialized"]

log = logging.getLogger("smp_compat.v2")

_PG_TIMEOUT = datetime.timedelta(minutes=30)
_GLOO_DRAIN_SECONDS = 0.2


def is_initialized() -> bool:
    """True once ``tsm.init()`` has run in this process."""
    return state.initialized


def init(config: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> None:
    """Start SMP v2: config (SM_HP_MP_PARAMETERS over ``config`` over values written to ``tsm.state``), process
    group, the ("rep", "shard", "cp", "tp") device mesh, the replica groups and the RNG tracker; then the
    stand-ins that act on model construction (flash-attention 2 -> sdpa, fp8 off where it cannot run)."""
    cfg = resolve_v2_config(config, written=state.written_before_init())
    if state.initialized:
        if cfg == state.config:
            return
        raise SMPConfigError(
            f"tsm.init() already ran with {state.config.model_dump()}; a second call asks for {cfg.model_dump()}. "
            "Call tsm.init() once per process."
        )
    local_world = _join_process_group()
    if "gloo" in str(dist.get_backend()):
        atexit.register(_let_gloo_release_tensors)
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg.check_world_size(world)
    shard = resolve_shard_degree(cfg.hybrid_shard_degree, world, cfg.tensor_parallel_degree, local_world)
    layout = Layout(world, cfg.tensor_parallel_degree, cfg.context_parallel_degree, shard, cfg.expert_parallel_degree)
    device_type = _device_type()
    if device_type == "cuda":
        _select_gpu(rank)
    mesh = build_mesh(layout, device_type)
    rep_group = _rep_rank_group(layout, rank)
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, cfg.random_seed + layout.coords(rank).tp)
    state._initialize(cfg, layout, rank, mesh, rep_group, tracker, local_world)
    from smp_compat.v2.fsdp import install  # the FSDP1 constructor serves the v2 layout from here on

    install()
    install_sdpa_fallback()  # the scripts build their model after tsm.init()
    guard_real_fp8_autocast()
    if rank == 0:
        log.info("SMP v2 (smp_compat) initialized: %s; %s", cfg.model_dump(), layout.rank_table()[0])


def _let_gloo_release_tensors() -> None:
    """At exit, a pause while the interpreter is whole, for gloo's workers to drop the last collective's tensors.

    A gloo worker thread releases a finished collective's tensors a moment after the caller went on; on a busy
    CPU that can fall after Python began finalizing, and releasing a tensor that Python owns then aborts the
    process ("terminate called without an active exception", torch's gloo). Measured on the loaded 2-core machine
    with tests/v2/scripts/probe_launch.py (an all-reduce, then exit) at world 2: 10 runs of 53 aborted without
    the pause, none of 14 with it.
    """
    time.sleep(_GLOO_DRAIN_SECONDS)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The 4-D mesh over every rank (collective: every rank calls it with the same layout)."""
    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=DIMS)


def _device_type() -> str:
    """"cuda" when the default group talks NCCL (or SMDDP, which maps to it), else "cpu"."""
    backend = str(dist.get_backend())
    return "cuda" if ("nccl" in backend or "smddp" in backend) and torch.cuda.is_available() else "cpu"


def _select_gpu(rank: int) -> None:
    """AWS's scripts call ``torch.cuda.set_device(rank % device_count)`` only after ``tsm.init()``, while the mesh's
    NCCL groups are made here: a process still on the default GPU 0 moves to that same GPU now, so that the
    groups of one node are not all created on GPU 0. A device the script already chose is kept."""
    index = rank % torch.cuda.device_count()
    if torch.cuda.current_device() == 0 and index != 0:
        torch.cuda.set_device(index)


def _join_process_group() -> int:
    """Use the script's process group or start one; return the number of processes on this node."""
    if dist.is_initialized():
        return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    launch = detect_launch()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus and launch.local_size <= gpus else "gloo"
    if launch.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif launch.launcher == "torchrun":
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, timeout=_PG_TIMEOUT)
    else:
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                              is_master=launch.rank == 0, timeout=_PG_TIMEOUT)  # fmt: skip
        dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                timeout=_PG_TIMEOUT)  # fmt: skip
    for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size), ("LOCAL_RANK", launch.local_rank),
                        ("LOCAL_WORLD_SIZE", launch.local_size)):  # fmt: skip
        os.environ.setdefault(name, str(value))
    return launch.local_size


def _rep_rank_group(layout: Layout, rank: int) -> Any:
    """SMP's ``rep_rank_process_group``: the ranks of this rank's replica (every rank creates every group)."""
    if layout.rep == 1:
        return dist.group.WORLD
    mine = None
    for members in layout.all_groups(layout.rep_rank_group):
        group = dist.new_group(members)
        if rank in members:
            mine = group
    return mine

