"""The sharding DeviceMesh: SMP's sharding groups are consecutive blocks of ``sdp`` data-parallel ranks.

With ``dp // sdp`` replicas the mesh is ``(sdp_rep, sdp_shard)`` (row-major, so the groups are
``[k*sdp, (k+1)*sdp)``, as in SMP's documented layout) and FSDP2 runs as HSDP: reduce-scatter inside
a sharding group, all-reduce across replicas. The mesh's device type is always given explicitly
(a CPU job must not let FSDP2 pick CUDA: pytorch/pytorch#132471).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.globalstate import state

__all__ = ["build_mesh", "shard_dim_mesh"]

_cache: dict[tuple[int, int, int, str], DeviceMesh] = {}


def build_mesh() -> DeviceMesh:
    """This job's FSDP mesh (created once per process, collectively on every rank)."""
    topo = state.topology
    sdp = state.cfg.sharded_data_parallel_degree
    members = topo.group("dp", state.rank)
    if len(members) % sdp:
        raise SMPConfigError(
            f"sharded_data_parallel_degree ({sdp}) must divide the data-parallel degree ({len(members)}); "
            f"choose a divisor of {len(members)}."
        )
    if state.device.type == "cuda" and state.backend != "nccl":
        raise SMPUnsupportedError(
            f"sharded data parallelism on GPUs shared by several processes (backend {state.backend!r}): FSDP2's "
            "collectives on CUDA tensors need NCCL, and NCCL needs one GPU per process (over gloo the process "
            "crashed, measured on an H100). Start one process per GPU, or run on the CPU (CUDA_VISIBLE_DEVICES=)."
        )
    key = (id(state.launch), len(members), sdp, state.device.type)  # a new smp.init gets new groups
    if key not in _cache:
        reps = len(members) // sdp
        ranks = torch.tensor(members, dtype=torch.int64)
        if reps == 1:
            _cache[key] = DeviceMesh(state.device.type, ranks, mesh_dim_names=("sdp_shard",))
        else:
            _cache[key] = DeviceMesh(state.device.type, ranks.view(reps, sdp), mesh_dim_names=("sdp_rep", "sdp_shard"))
    return _cache[key]


def shard_dim_mesh() -> DeviceMesh:
    """The 1-D mesh of this rank's sharding group (where a sharded tensor's pieces live)."""
    mesh = build_mesh()
    return mesh["sdp_shard"] if mesh.ndim > 1 else mesh


def reset() -> None:
    """Forget the meshes (their groups die with the process group)."""
    _cache.clear()
