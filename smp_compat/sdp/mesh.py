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

_cache: dict[tuple[int, int, str], tuple[object, DeviceMesh]] = {}
"""``(rdp size, sdp, device type) -> (the smp.init it belongs to, its mesh)``. The launch object itself is kept
and compared by identity: keyed by ``id()``, a re-init's new launch object could reuse the freed old one's
address on some ranks only, which then skipped the collective group creation the others waited in (a hang,
about 1 run in 6 of a re-init at tp 2 x sdp 2)."""


def build_mesh() -> DeviceMesh:
    """This job's FSDP mesh (created once per process, collectively on every rank)."""
    topo = state.topology
    sdp = state.cfg.sharded_data_parallel_degree
    members = topo.group("rdp", state.rank)  # the dp group at tp = 1; sdp shards over rdp under tp (SMP 1.15)
    if len(members) % sdp:
        raise SMPConfigError(
            f"sharded_data_parallel_degree ({sdp}) must divide the reduced-data-parallel degree ({len(members)} = "
            f"dp / tensor_parallel_degree); choose a divisor of {len(members)}."
        )
    if state.device.type == "cuda" and state.backend != "nccl":
        raise SMPUnsupportedError(
            f"sharded data parallelism on GPUs shared by several processes (backend {state.backend!r}): FSDP2's "
            "collectives on CUDA tensors need NCCL, and NCCL needs one GPU per process (over gloo the process "
            "crashed, measured on an H100). Start one process per GPU, or run on the CPU (CUDA_VISIBLE_DEVICES=)."
        )
    key = (len(members), sdp, state.device.type)
    cached = _cache.get(key)
    if cached is None or cached[0] is not state.launch:  # a new smp.init gets new groups, on every rank
        _cache[key] = (state.launch, _tp_mesh(sdp) if topo.tp_size > 1 else _dp_mesh(members, sdp))
    return _cache[key][1]


def _dp_mesh(members: list[int], sdp: int) -> DeviceMesh:
    """Without tensor parallelism: the rdp group as ``(sdp_rep, sdp_shard)``, or ``(sdp_shard,)`` alone."""
    reps = len(members) // sdp
    ranks = torch.tensor(members, dtype=torch.int64)
    if reps == 1:
        return DeviceMesh(state.device.type, ranks, mesh_dim_names=("sdp_shard",))
    return DeviceMesh(state.device.type, ranks.view(reps, sdp), mesh_dim_names=("sdp_rep", "sdp_shard"))


def _tp_mesh(sdp: int) -> DeviceMesh:
    """With tensor parallelism: the whole job as ``(sdp_rep, sdp_shard, tp)`` (SMP 1.15's layout, DG-SDP
    example 2), sliced to its sharding dims: FSDP2 shards over the rdp group, each tp rank its own slices."""
    topo = state.topology
    reps = topo.rdp_size // sdp
    ranks = torch.tensor(
        [[[topo.rank_of(0, t, r * sdp + s) for t in range(topo.tp_size)] for s in range(sdp)] for r in range(reps)],
        dtype=torch.int64,
    )
    full = DeviceMesh(state.device.type, ranks, mesh_dim_names=("sdp_rep", "sdp_shard", "tp"))
    return full["sdp_rep", "sdp_shard"] if reps > 1 else full["sdp_shard"]


def shard_dim_mesh() -> DeviceMesh:
    """The 1-D mesh of this rank's sharding group (where a sharded tensor's pieces live)."""
    mesh = build_mesh()
    return mesh["sdp_shard"] if mesh.ndim > 1 else mesh


def reset() -> None:
    """Forget the meshes (their groups die with the process group)."""
    _cache.clear()
