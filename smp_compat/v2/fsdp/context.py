"""What the FSDP façade reads from ``tsm.state``: the degrees and the meshes, in one place.

The façade is active only after ``tsm.init()``; before that (or in a process that never calls it)
``current()`` is ``None`` and ``FullyShardedDataParallel(...)`` is PyTorch's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Context", "current"]


@dataclass(frozen=True)
class Context:
    """The v2 job as the façade needs it.

    ``mesh`` is the root mesh with dims ("rep", "shard", "cp", "tp") that ``tsm.init`` built; tensor-parallel
    parameters are DTensors on its "tp" slice, so FSDP must shard over a slice of the same root mesh.
    ``mesh_for(shard)`` is the same kind of mesh for another shard-group size (native FSDP at H == 0, tp 1);
    ``report_resolved`` records the FSDP group size the façade chose in ``tsm.state`` (see layout.py).
    """

    hybrid_shard_degree: int
    tp_size: int
    cp_size: int
    mesh: DeviceMesh
    local_world_size: int
    mesh_for: Callable[[int], DeviceMesh]
    report_resolved: Callable[[int], None]
    ep_size: int = 1  # expert_parallel_degree: FSDP runs per ep rank (smp_compat/v2/moe/ep.py)


def current() -> Context | None:
    """The active v2 context, or None when ``tsm.init()`` has not run in this process."""
    from smp_compat.v2.state import state

    if not state.initialized:
        return None

    def report(size: int) -> None:
        state.resolved_hybrid_shard_degree = size

    return Context(
        hybrid_shard_degree=state.hybrid_shard_degree,
        tp_size=state.tensor_parallel_degree,
        cp_size=state.context_parallel_degree,
        mesh=state.device_mesh,
        local_world_size=state.local_world_size,
        mesh_for=state.mesh_for,
        report_resolved=report,
        ep_size=state.expert_parallel_degree,
    )
