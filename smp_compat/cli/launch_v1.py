"""SMP v1's part of a launch: its config checked on its own, the parameters exported, the rank layout shown.

``launch_config.resolve_smp`` builds it when the config is for SMP v1 (``smdistributed.modelparallel.torch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from smp_compat.config import SMPConfig, resolve_config
from smp_compat.errors import SMPConfigError
from smp_compat.topology import Topology

if TYPE_CHECKING:
    from smp_compat.cli.launch_config import LaunchConfig

__all__ = ["V1Launch"]

_TABLE_COLUMNS = ("rank", "pp_rank", "tp_rank", "rdp_rank", "dp_rank", "mp_rank")
_GROUP_AXES = ("pp", "tp", "rdp", "dp", "mp")


@dataclass(frozen=True)
class V1Launch:
    """The launch config and the SMP v1 config it resolves to (the defaults where the launch sets nothing)."""

    launch: LaunchConfig
    config: SMPConfig

    @classmethod
    def resolve(cls, launch: LaunchConfig) -> V1Launch:
        """Validate the launch config on its own (the launcher cannot see the script's smp.init dict)."""
        try:
            return cls(launch, resolve_config(launch.parameters or {}, environ={}))
        except SMPConfigError as exc:
            raise SMPConfigError(
                f"{exc}\n(From {launch.source}. The launcher checks it on its own, so give the complete SMP "
                "parameters there; its keys override those of the script's smp.init dict, as on SageMaker.)"
            ) from None

    def exported_parameters(self) -> dict[str, Any] | None:
        """The parameters plus ``partitions``, SMP's old name for the pipeline degree.

        SageMaker's SDK required ``partitions``, and Hugging Face's ``is_sagemaker_mp_enabled()`` looks for it.
        """
        if self.launch.parameters is None:
            return None
        return {**self.launch.parameters, "partitions": self.config.pipeline_parallel_degree}

    def world_size_problem(self, world_size: int, nnodes: int | None, nproc_per_node: int | None) -> str | None:
        """The degrees checked against the world size (nothing to check when the script's dict decides)."""
        if self.launch.parameters is None:
            return None
        try:
            self.config.check_world_size(world_size)
        except SMPConfigError as exc:
            return (
                f"{exc} (World size {world_size} = {nnodes} node(s) x {nproc_per_node} process(es); "
                f"config from {self.launch.source}. smp.init will fail the same way unless the script's own "
                "smp.init dict supplies the missing keys.)"
            )
        return None

    def print_layout(self, world_size: int, nnodes: int | None, nproc_per_node: int | None) -> None:
        """The degrees, then tables through rich: one row per rank, every group's members per axis."""
        cfg = self.config
        topology = Topology.build(
            world_size, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.placement_strategy
        )
        print(
            f"World size {world_size} = {nnodes} node(s) x {nproc_per_node} process(es) per node; "
            f"pipeline_parallel_degree {cfg.pipeline_parallel_degree}, tensor_parallel_degree "
            f"{cfg.tensor_parallel_degree}, placement_strategy {cfg.placement_strategy!r} ({topology.placement})."
        )
        console = Console(markup=False, highlight=False, soft_wrap=False)
        for table in _layout_tables(topology):
            console.print(table)
        print("Groups list global ranks; entry i of a group has group rank i.")


def _layout_tables(topology: Topology) -> tuple[Table, Table]:
    """One row per rank with every coordinate, and every group's members per axis."""
    ranks = Table(title="Ranks", box=box.SIMPLE)
    for column in _TABLE_COLUMNS:
        ranks.add_column(column, justify="right")
    for c in topology.table():
        ranks.add_row(*(str(getattr(c, column)) for column in _TABLE_COLUMNS))
    groups = Table(title="Groups", box=box.SIMPLE)
    groups.add_column("axis")
    groups.add_column("groups", overflow="fold")
    for axis in _GROUP_AXES:
        groups.add_row(axis, " ".join(str(members) for members in topology.all_groups(axis)))
    return ranks, groups
