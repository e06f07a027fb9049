"""What the FSDP façade reads from ``tsm.state``: the degrees and the root mesh, in one place.

The façade is active only after ``tsm.init()``; before that (or in a process that never calls it)
``current()`` is ``None`` and ``FullyShardedDataParallel(...)`` is PyTorch's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Context", "current", "use_context"]


@dataclass(frozen=True)
class Context:
    """The v2 job as the façade needs it.

    ``mesh`` is the root mesh with dims ("rep", "shard", "cp", "tp") that ``tsm.init`` built; tensor-parallel
    parameters are DTensors on its "tp" slice, so FSDP must shard over a slice of the same root mesh.
    ``report_resolved`` tells the state which FSDP group size the façade chose (see layout.py).
    """

    hybrid_shard_degree: int
    tp_size: int
    cp_size: int
    mesh: DeviceMesh
    local_world_size: int
    report_resolved: Callable[[int], None] | None = None


_override: Context | None = None


def use_context(ctx: Context | None) -> None:
    """Set (or clear, with None) the context explicitly; tests and ``tsm.init`` call this."""
    global _override
    _override = ctx


def current() -> Context | None:
    """The active v2 context, or None when ``tsm.init()`` has not run in this process."""
    return _override
