"""SMP v2's FSDP: the scripts' FSDP1 call, served by PyTorch's FSDP2 after ``tsm.init()``.

AWS's v2 scripts call ``FullyShardedDataParallel(model, auto_wrap_policy=..., mixed_precision=...,
sharding_strategy=..., param_init_fn=..., post_param_init_fn=..., sync_module_states=...)`` with no process
group; SMP's own PyTorch build picked the groups from ``hybrid_shard_degree``. On stock PyTorch FSDP1
trains silently wrong at hybrid shard degree 1, corrupts optimizer state on a sharded load with tensor
parallelism and crashes a CPU full state dict (reference §10), and each fix patches private modules;
FSDP2 ran every layout exactly with public APIs. So after ``tsm.init()`` the FSDP1 constructor returns the
model sharded by ``fully_shard`` on the ("rep", "shard") slice of ``tsm.state``'s mesh, carrying FSDP1's
attributes (``process_group``, ``rank``, ``world_size``, ``sharding_strategy``, ``mixed_precision``), and
FSDP1's state-dict static methods dispatch to FSDP2 logic for such models (state_dicts.py has the contract).

Modules: context (what is read from tsm.state), layout (groups and strategy), policies (auto-wrap units),
build (the constructor), broadcast (sync_module_states), state_dicts, reshard (the parameters the optimizer
holds, registered again after a forward with no backward), patches (the class attributes).
"""

from __future__ import annotations

from smp_compat.v2.fsdp.build import facade_state
from smp_compat.v2.fsdp.context import Context, current
from smp_compat.v2.fsdp.patches import install, installed

__all__ = ["Context", "current", "install", "installed", "facade_state", "is_facade"]


def is_facade(module: object) -> bool:
    """True for a model the façade built (the object ``FullyShardedDataParallel(...)`` returned)."""
    return hasattr(module, "__dict__") and facade_state(module) is not None  # type: ignore[arg-type]
