"""FSDP's mesh under context parallelism: the shard group holds the data shards *and* the cp ranks.

Every cp rank holds a copy of the same weights and computes a part of the same loss, so FSDP shards the
parameters over (shard x cp) together and averages gradients over them. FSDP2 takes a 2-D (replicate, shard)
mesh; the ("shard", "cp") dims of ``tsm.state.device_mesh`` become one with ``DeviceMesh._flatten``, PyTorch's
only way to merge dims of a mesh while keeping its root (the tensor-parallel DTensors live on that root's "tp"
slice, and FSDP2 requires one root), and ``DeviceMesh._concatenate`` puts "rep" beside it (slicing the
flattened dim off the root warns of deprecation in torch 2.13). Those private calls are isolated here.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from smp_compat.errors import SMPConfigError

__all__ = ["SHARD_CP", "fsdp_mesh"]

SHARD_CP = "shard_cp"


def fsdp_mesh(root: DeviceMesh, rep: int, shard: int) -> DeviceMesh | None:
    """The ("rep", "shard_cp") mesh of ``root`` when it has ``rep`` replicas of ``shard`` ranks, else None."""
    sizes = dict(zip(root.mesh_dim_names or (), root.mesh.shape))
    cp = sizes.get("cp", 1)
    if shard % cp:
        raise SMPConfigError(
            f"FSDP shard group of {shard} ranks under context_parallel_degree {cp}: the shard group must hold whole "
            "context-parallel groups; set hybrid_shard_degree to a multiple of context_parallel_degree."
        )
    if sizes.get("rep") != rep or sizes.get("shard", 1) * cp != shard:
        return None
    flat = root["shard", "cp"]._flatten(SHARD_CP)
    return DeviceMesh._concatenate([root["rep"], flat])  # slicing a flattened dim off the root is deprecated
