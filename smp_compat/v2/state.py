"""``tsm.state``: SMP v2's singleton, importable and writable before ``tsm.init()`` and filled in by it.

AWS's scripts write ``state.tensor_parallel_degree = 1`` (and cp, ep) before ``tsm.init()`` when they run
without SMP's layers; init keeps such a value unless the config sets that key. Config keys read their value
(or their default) at any time; ranks and groups exist only after init.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from smp_compat.errors import SMPConfigError, SMPNotInitializedError
from smp_compat.v2.config import V2_KEYS, SMPv2Config
from smp_compat.v2.layout import Layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from smp_compat.v2.rng import RNGStatesTracker

__all__ = ["Ranker", "State", "reset", "state"]

_ALIASES = {"tp_size": "tensor_parallel_degree", "cp_size": "context_parallel_degree", "ep_size": "expert_parallel_degree"}
_DEFAULTS: dict[str, Any] = {key: field.default for key, field in SMPv2Config.model_fields.items()}


class Ranker:
    """Replication ranks (SMP's ``state.ranker``): which HSDP replica a rank is in; replica 0 writes checkpoints."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    def get_rep_rank(self, global_rank: int) -> int:
        """The replica index of ``global_rank`` (0 .. replicas - 1)."""
        return self._layout.coords(global_rank).rep

    def get_rep_groups(self) -> list[list[int]]:
        """Lists of global ranks that hold identical shards (one list per shard position)."""
        return self._layout.all_groups(self._layout.replicate_group)


def _config_value(key: str) -> property:
    """A config key as an attribute: the resolved value after init; before it, what the script wrote or the default."""

    def get(self: State) -> Any:
        if self._config is not None:
            return getattr(self._config, key)
        return self._written.get(key, _DEFAULTS[key])

    def set(self: State, value: Any) -> None:
        if self._config is not None:
            raise SMPConfigError(
                f"tsm.state.{key} is fixed once tsm.init() has run (the process groups are built from it); set it "
                "before tsm.init(), or in the config."
            )
        self._written[key] = value

    return property(get, set, doc=f"The config key {key!r} (writable before tsm.init()).")


class State:
    """SMP v2's state; one instance, :data:`state`."""

    def __init__(self) -> None:
        self._config: SMPv2Config | None = None
        self._written: dict[str, Any] = {}
        self._layout: Layout | None = None
        self._rank = 0
        self._mesh: DeviceMesh | None = None
        self._tracker: RNGStatesTracker | None = None
        self._rep_rank_group: ProcessGroup | None = None
        self.local_world_size = 1
        self._meshes: dict[int, DeviceMesh] = {}
        self.resolved_hybrid_shard_degree: int | None = None
        """The FSDP group size in use (``model.process_group``'s): set by init, then by the FSDP façade, which
        decides at hybrid_shard_degree 0 and tp 1, and at hybrid_shard_degree 1 (nothing sharded) makes the group
        every data-parallel rank, as FSDP1's NO_SHARD (smp_compat/v2/fsdp/layout.py says why)."""

    for _key in sorted(V2_KEYS):
        locals()[_key] = _config_value(_key)
    for _alias, _key in _ALIASES.items():
        locals()[_alias] = _config_value(_key)
    del _key, _alias

    @property
    def initialized(self) -> bool:
        return self._config is not None

    def written_before_init(self) -> dict[str, Any]:
        """Config keys the script set on the state before init (init merges them under the config)."""
        return dict(self._written)

    def _require(self, what: str) -> Any:
        if self._config is None:
            raise SMPNotInitializedError(f"tsm.state.{what} exists only after tsm.init(); call tsm.init() first.")

    @property
    def config(self) -> SMPv2Config:
        self._require("config")
        return self._config  # type: ignore[return-value]

    @property
    def layout(self) -> Layout:
        """The rank layout (pure arithmetic; see smp_compat.v2.layout)."""
        self._require("layout")
        return self._layout  # type: ignore[return-value]

    @property
    def rank(self) -> int:
        self._require("rank")
        return self._rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank).tp

    @property
    def cp_rank(self) -> int:
        return self.layout.coords(self.rank).cp

    @property
    def ep_rank(self) -> int:
        """Rank in the expert-parallel group: innermost among the data-parallel ranks (smp_compat/v2/moe/ep.py)."""
        self._require("ep_rank")
        return self.dp_rank % self.layout.ep

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ("rep", "shard", "cp", "tp") mesh over every rank; slice it by name (``mesh["rep", "shard"]``)."""
        self._require("device_mesh")
        return self._mesh  # type: ignore[return-value]

    @property
    def tp_process_group(self) -> ProcessGroup:
        return self.device_mesh.get_group("tp")

    @property
    def cp_process_group(self) -> ProcessGroup:
        return self.device_mesh.get_group("cp")

    @property
    def world_process_group(self) -> ProcessGroup:
        self._require("world_process_group")
        import torch.distributed as dist

        return dist.group.WORLD  # type: ignore[return-value]

    @property
    def rep_rank_process_group(self) -> ProcessGroup:
        """All ranks with this rank's replication rank (one replica's shard, cp and tp ranks)."""
        self._require("rep_rank_process_group")
        return self._rep_rank_group  # type: ignore[return-value]

    @property
    def ranker(self) -> Ranker:
        """Replicas of the FSDP group: at hybrid_shard_degree 1, once FSDP is built, one group of every
        data-parallel rank, so every rank is replica 0 and writes its part of a sharded checkpoint."""
        layout, fsdp = self.layout, self.resolved_hybrid_shard_degree
        if fsdp is not None and fsdp != layout.shard_degree:
            layout = Layout(layout.world_size, layout.tp, layout.cp, fsdp, layout.ep)
        return Ranker(layout)

    def get_rng_state_tracker(self) -> RNGStatesTracker:
        """The tensor-parallel RNG tracker, seeded ``random_seed + tp_rank`` at init (Megatron's API)."""
        self._require("get_rng_state_tracker()")
        return self._tracker  # type: ignore[return-value]

    def _initialize(self, config: SMPv2Config, layout: Layout, rank: int, mesh: DeviceMesh,
                    rep_rank_group: ProcessGroup, tracker: RNGStatesTracker, local_world_size: int) -> None:  # fmt: skip
        """Called by tsm.init once the groups exist."""
        self._config, self._layout, self._rank, self._mesh = config, layout, rank, mesh
        self._rep_rank_group, self._tracker, self.local_world_size = rep_rank_group, tracker, local_world_size
        native = config.hybrid_shard_degree == 0 and config.tensor_parallel_degree == 1
        self.resolved_hybrid_shard_degree = None if native else layout.shard_degree
        self._meshes = {layout.shard_degree: mesh}

    def mesh_for(self, shard_degree: int) -> DeviceMesh:
        """The ("rep", "shard", "cp", "tp") mesh for another shard group size (native FSDP's choice at
        hybrid_shard_degree 0, tp 1); built once, collectively: every rank must ask for the same size."""
        self._require("mesh_for()")
        if shard_degree not in self._meshes:
            from smp_compat.v2.startup import build_mesh

            layout = Layout(self.world_size, self.layout.tp, self.layout.cp, shard_degree, self.layout.ep)
            self._meshes[shard_degree] = build_mesh(layout, self.device_mesh.device_type)
        return self._meshes[shard_degree]

    def _reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def reset(self) -> None:
        """SMP's ``tsm.state.reset()``: forget init and every value written before it, so ``tsm.init`` may run
        again (HyperPod's adapter tests call it between jobs). Process groups stay as they are."""
        self._reset()


state = State()
"""The singleton scripts import as ``from torch.sagemaker import state``."""


def reset() -> None:
    """Forget init and every value written before it (tests; a new job in the same process)."""
    state._reset()
