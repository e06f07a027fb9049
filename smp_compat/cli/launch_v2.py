"""SMP v2's part of a launch (``torch.sagemaker``): its config checked on its own, the parameters exported, the
rank layout shown (tp, cp, ep, shard and replica groups per rank).

``launch_config.resolve_smp`` builds it when the config is for SMP v2: a SageMaker distribution with
``torch_distributed`` and ``smdistributed.modelparallel`` (the SDK's own rule), or bare parameters with a key
only SMP v2 has. SageMaker launches v2 with torchrun and hands the parameters over as SM_HP_MP_PARAMETERS,
as ``smp-compat run`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from smp_compat.errors import SMPConfigError
from smp_compat.v2.config import SMPv2Config, resolve_v2_config
from smp_compat.v2.layout import Layout, resolve_shard_degree

if TYPE_CHECKING:
    from smp_compat.cli.launch_config import LaunchConfig

__all__ = ["V2Launch"]

_GROUPS = (("tp", "tp_group"), ("cp", "cp_group"), ("shard", "shard_group"), ("replicas", "replicate_group"))


@dataclass(frozen=True)
class V2Launch:
    """The launch config and the SMP v2 config it resolves to (the defaults where the launch sets nothing)."""

    launch: LaunchConfig
    config: SMPv2Config

    @classmethod
    def resolve(cls, launch: LaunchConfig) -> V2Launch:
        """Validate the launch config on its own (the launcher cannot see the script's tsm.init argument)."""
        try:
            config = resolve_v2_config(launch.parameters or {}, environ={})
        except SMPConfigError as exc:
            raise SMPConfigError(
                f"{exc}\n(From {launch.source}. Its keys override those of the script's tsm.init argument, as on "
                "SageMaker.)"
            ) from None
        return cls(launch, config)

    def exported_parameters(self) -> dict[str, Any] | None:
        """The parameters as given: tsm.init reads them from SM_HP_MP_PARAMETERS in every process."""
        return None if self.launch.parameters is None else dict(self.launch.parameters)

    def world_size_problem(self, world_size: int, nnodes: int | None, nproc_per_node: int | None) -> str | None:
        """The degrees checked against the world size, as tsm.init will check them."""
        try:
            self.config.check_world_size(world_size)
        except SMPConfigError as exc:
            return (f"{exc} (World size {world_size} = {nnodes} node(s) x {nproc_per_node} process(es); config "
                    f"from {self.launch.source}.)")  # fmt: skip
        return None

    def layout(self, world_size: int, nproc_per_node: int | None) -> Layout:
        """The layout tsm.init builds (at hybrid_shard_degree 0 and tp 1: full sharding, the FSDP default)."""
        cfg = self.config
        shard = resolve_shard_degree(cfg.hybrid_shard_degree, world_size, cfg.tensor_parallel_degree, nproc_per_node)
        return Layout(world_size, cfg.tensor_parallel_degree, cfg.context_parallel_degree, shard,
                      cfg.expert_parallel_degree)  # fmt: skip

    def print_layout(self, world_size: int, nnodes: int | None, nproc_per_node: int | None) -> None:
        """The degrees, then tables through rich: one row per rank, every group's members per kind."""
        if self.world_size_problem(world_size, nnodes, nproc_per_node):
            print(f"World size {world_size}: the SMP v2 degrees do not fit (see the error below); no layout.")
            return
        layout = self.layout(world_size, nproc_per_node)
        cfg = self.config
        print(
            f"SMP v2 (torch.sagemaker). World size {world_size} = {nnodes} node(s) x {nproc_per_node} process(es) "
            f"per node; tensor_parallel_degree {cfg.tensor_parallel_degree}, context_parallel_degree "
            f"{cfg.context_parallel_degree}, expert_parallel_degree {cfg.expert_parallel_degree}, "
            f"hybrid_shard_degree {cfg.hybrid_shard_degree} -> shard groups of {layout.shard_degree} rank(s), "
            f"{layout.rep} replica(s). Mesh (rep, shard, cp, tp) = {layout.mesh_shape}."
        )
        if cfg.hybrid_shard_degree == 0 and cfg.tensor_parallel_degree == 1:
            node = nproc_per_node or world_size
            print(f"hybrid_shard_degree 0 at tp 1 is native FSDP: the script's sharding_strategy decides "
                  f"(shown: FULL_SHARD; HYBRID_SHARD shards within a node of {node}; NO_SHARD replicates).")  # fmt: skip
        console = Console(markup=False, highlight=False, soft_wrap=False)
        for table in _layout_tables(layout):
            console.print(table)
        print("Groups list global ranks; entry i of a group has group rank i. Replica 0 writes sharded checkpoints.")


def _layout_tables(layout: Layout) -> tuple[Table, Table]:
    """One row per rank with every coordinate, and every group's members per kind."""
    ranks = Table(title="Ranks", box=box.SIMPLE)
    for column in ("rank", "tp_rank", "cp_rank", "ep_rank", "dp_rank", "rep_rank"):
        ranks.add_column(column, justify="right")
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        ranks.add_row(*(str(v) for v in (rank, c.tp, c.cp, 0, layout.dp_rank(rank), c.rep)))
    groups = Table(title="Groups", box=box.SIMPLE)
    groups.add_column("kind")
    groups.add_column("groups", overflow="fold")
    for kind, method in _GROUPS:
        groups.add_row(kind, " ".join(str(members) for members in layout.all_groups(getattr(layout, method))))
    groups.add_row("ep", " ".join(str([r]) for r in range(layout.world_size)))
    return ranks, groups
