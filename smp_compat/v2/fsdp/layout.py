"""Which ranks shard and which replicate: the script's ``sharding_strategy`` and ``hybrid_shard_degree``.

SMP v2's rules (reference §2.1): ``hybrid_shard_degree`` H >= 2 is the size of the FSDP shard group and
forces ``HYBRID_SHARD`` (``_HYBRID_SHARD_ZERO2`` stays); H == 1 replicates (SMP's ``NO_SHARD``); H == 0
with tensor parallelism shards over every data-parallel rank, and H == 0 without it is native FSDP: the
script's strategy decides (full strategies over all ranks, hybrid ones over ``LOCAL_WORLD_SIZE`` ranks,
``NO_SHARD`` replicates).

``model.process_group`` is the FSDP group as FSDP1 defines it: the shard group, or at H == 1 (nothing
sharded) every data-parallel rank of this tensor-parallel column, as FSDP1's ``NO_SHARD`` group is.
The scripts take it for checkpoint coordination (DCP's group; only replication rank 0 writes) and for
timing statistics; a one-rank group would break ``statistics.stdev`` there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import ShardingStrategy

from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.v2.fsdp.context import Context
from smp_compat.v2.layout import resolve_shard_degree

__all__ = ["FsdpLayout", "resolve"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
_NO_RESHARD = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2, ShardingStrategy.NO_SHARD)


@dataclass(frozen=True)
class FsdpLayout:
    """The resolved layout: FSDP2's 2-D mesh, the strategy in effect, and FSDP1's group attributes."""

    mesh: DeviceMesh  # ("rep", "shard"), or ("rep", "shard_cp") under context parallelism
    strategy: ShardingStrategy
    reshard_after_forward: bool
    process_group: dist.ProcessGroup
    shard_degree: int  # ranks sharing one copy of the parameters (1: replicated)
    expert_mesh: DeviceMesh | None = None  # expert parallelism: the experts' ("rep", "shard") mesh
    shard_group_size: int | None = None  # expert parallelism: the whole shard group (ep x process_group)

    @property
    def group_size(self) -> int:
        """Size of ``process_group`` (the value ``tsm.state`` reports as the resolved shard-group size);
        under expert parallelism the whole shard group's, of which ``process_group`` is one ep rank's part."""
        return self.shard_group_size or dist.get_world_size(self.process_group)


def resolve(ctx: Context, strategy: ShardingStrategy | None) -> FsdpLayout:
    """Apply SMP's rules to the script's strategy (FSDP1's default: FULL_SHARD)."""
    strategy = ShardingStrategy.FULL_SHARD if strategy is None else strategy
    world = ctx.mesh.size()
    dp = world // ctx.tp_size  # data-parallel ranks incl. context-parallel ones
    h = ctx.hybrid_shard_degree
    shard = resolve_shard_degree(h, world, ctx.tp_size, ctx.local_world_size, strategy)
    if shard == 1:
        strategy = ShardingStrategy.NO_SHARD
    elif h >= 2 and strategy not in _HYBRID:
        strategy = ShardingStrategy.HYBRID_SHARD
    elif strategy is ShardingStrategy.NO_SHARD:  # hybrid_shard_degree 0 with tp: SMP shards over every dp rank
        strategy = ShardingStrategy.FULL_SHARD
    if dp % shard:
        raise SMPConfigError(
            f"FSDP shard group of {shard} ranks does not divide the {dp} data-parallel ranks "
            f"(hybrid_shard_degree={h}, sharding_strategy={strategy.name}, LOCAL_WORLD_SIZE={ctx.local_world_size})."
        )
    if ctx.ep_size > 1:
        return _ep_layout(ctx, strategy, dp // shard, shard)
    mesh = _fsdp_mesh(ctx, dp // shard, shard)
    group = mesh.get_group(0) if shard == 1 else mesh.get_group(1)  # (rep, shard) or (rep, shard_cp)
    return FsdpLayout(mesh, strategy, strategy not in _NO_RESHARD, group, shard)


def _fsdp_mesh(ctx: Context, rep: int, shard: int) -> DeviceMesh:
    """The ("rep", "shard") slice of the root mesh, or of ``tsm.state``'s mesh for another shard size (tp 1)."""
    if ctx.cp_size > 1:  # the shard group spans shard x cp (context_parallel/mesh.py)
        from smp_compat.v2.context_parallel.mesh import fsdp_mesh

        found = fsdp_mesh(ctx.mesh, rep, shard)
        if found is not None or ctx.tp_size == 1:
            return found or fsdp_mesh(ctx.mesh_for(shard), rep, shard)  # type: ignore[return-value]
    sizes = dict(zip(ctx.mesh.mesh_dim_names or (), ctx.mesh.mesh.shape))
    if sizes.get("rep") == rep and sizes.get("shard") == shard:
        return ctx.mesh["rep", "shard"]
    if ctx.tp_size > 1:
        raise SMPUnsupportedError(
            f"an FSDP layout of {rep} replicas x {shard} shards with tensor_parallel_degree={ctx.tp_size}, when "
            f"tsm.init() built {sizes.get('rep')} x {sizes.get('shard')}: tensor-parallel parameters live on that "
            "mesh; set hybrid_shard_degree to the shard degree you want instead of relying on sharding_strategy."
        )
    return ctx.mesh_for(shard)["rep", "shard"]


def _ep_layout(ctx: Context, strategy: ShardingStrategy, rep: int, shard: int) -> FsdpLayout:
    """Expert parallelism: shared weights on (rep x ep, shard / ep), experts on (rep, shard / ep) of this ep rank."""
    from smp_compat.v2.moe.ep import fsdp_meshes

    meshes = fsdp_meshes(ctx.mesh.device_type, ctx.mesh.size(), rep, shard, ctx.ep_size, ctx.tp_size, ctx.cp_size)
    group = meshes.shared.get_group("shard")
    return FsdpLayout(meshes.shared, strategy, strategy not in _NO_RESHARD, group, shard // ctx.ep_size,
                      meshes.experts, shard)  # fmt: skip
