"""Where expert parallelism sits in SMP v2's rank layout, and the FSDP meshes it needs.

EP lives inside data parallelism (ep ranks read different data; SMP refuses EP with tp). The
expert-parallel rank is innermost among the data-parallel ranks: ``ep_rank = dp_rank % ep``, so an ep group
is ``ep`` consecutive data-parallel ranks (on one node wherever the shard group is). The FSDP shard group of
S ranks (``hybrid_shard_degree``, or what the script's sharding strategy resolves to) splits into ``ep`` ×
``S / ep``; FSDP then runs on ``S / ep`` ranks of one ep rank:

- experts: sharded over the ``S / ep`` ranks with the same ep rank in the shard group, replicated over the
  ``rep`` shard groups (the mesh ("rep", "shard") of size ``rep x S/ep``, one per ep rank); their gradients
  already hold every ep peer's tokens, so the reduction divides by the data-parallel size, not the mesh's;
- everything else: sharded over the same ``S / ep`` ranks, replicated over ``rep x ep`` (HSDP on
  ("rep", "shard") = (rep*ep, S/ep)): every data-parallel rank's gradient is averaged.

So ``model.process_group`` (the shard group) holds one ep rank, and the scripts' ``ep{E}-{ep_rank}``
checkpoint folders each get one complete DCP checkpoint from replica 0: the ep rank's experts plus a full
copy of the shared weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smp_compat.errors import SMPConfigError, SMPUnsupportedError

__all__ = ["EpMeshes", "ep_group", "ep_rank", "fsdp_meshes", "is_expert_mesh", "expert_weight"]

_GROUPS: dict[tuple[int, int], tuple[object, dist.ProcessGroup]] = {}
_EXPERT_MESHES: list[DeviceMesh] = []


def ep_rank(dp_rank: int, ep: int) -> int:
    return dp_rank % ep


def ep_group(world: int, rank: int, ep: int) -> dist.ProcessGroup:
    """This rank's expert-parallel group (every rank creates every group once per default group)."""
    key = (id(dist.group.WORLD), ep)
    cached = _GROUPS.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    mine = None
    for first in range(0, world, ep):
        group = dist.new_group(list(range(first, first + ep)))
        if first <= rank < first + ep:
            mine = group
    if mine is None:
        raise SMPConfigError(f"rank {rank} is outside the world of {world} processes.")
    _GROUPS[key] = (dist.group.WORLD, mine)
    return mine


@dataclass(frozen=True)
class EpMeshes:
    """FSDP2's meshes under expert parallelism (module docstring)."""

    shared: DeviceMesh  # ("rep", "shard") = (rep * ep, S / ep)
    experts: DeviceMesh  # ("rep", "shard") = (rep, S / ep), this rank's ep rank only


def fsdp_meshes(device_type: str, world: int, rep: int, shard: int, ep: int, tp: int, cp: int) -> EpMeshes:
    """The meshes for a layout of ``rep`` shard groups of ``shard`` ranks; refusals name what does not fit."""
    if tp > 1 or cp > 1:
        raise SMPUnsupportedError(
            f"expert_parallel_degree ({ep}) with tensor_parallel_degree ({tp}) or context_parallel_degree ({cp}): "
            "SMP v2 refuses EP with tp, and smp_compat does not combine EP with context parallelism."
        )
    if shard % ep:
        raise SMPConfigError(
            f"expert_parallel_degree ({ep}) must divide the FSDP shard group ({shard} ranks): an expert-parallel "
            f"group lies inside a shard group. Set hybrid_shard_degree to a multiple of {ep} (not 1)."
        )
    ranks = torch.arange(world).view(rep, shard // ep, ep)
    flat = ranks.permute(0, 2, 1).reshape(rep * ep, shard // ep)
    shared = DeviceMesh(device_type, flat, mesh_dim_names=("rep", "shard"))
    by_ep = DeviceMesh(device_type, ranks.permute(2, 0, 1), mesh_dim_names=("ep", "rep", "shard"))
    experts = by_ep["rep", "shard"]
    _EXPERT_MESHES.append(experts)
    return EpMeshes(shared, experts)


def is_expert_mesh(mesh: DeviceMesh) -> bool:
    return any(m is mesh or (m.mesh.shape == mesh.mesh.shape and torch.equal(m.mesh, mesh.mesh))
               for m in _EXPERT_MESHES)  # fmt: skip


def expert_weight(mesh: DeviceMesh, ep: int) -> float:
    """How many times more a piece on ``mesh`` counts in a global norm than a piece on a whole-world mesh:
    the ep ranks hold different experts, so each expert mesh is one of ``ep`` disjoint parts, not a copy."""
    return float(ep) if is_expert_mesh(mesh) else 1.0


def _ep_peers() -> tuple[int, int, dist.ProcessGroup]:
    from smp_compat.v2.state import state

    ep = state.expert_parallel_degree
    return ep, state.ep_rank, ep_group(state.world_size, state.rank, ep)


def whole_experts(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A full expert stack from this ep rank's rows (``local``, gathered over its FSDP mesh): every ep rank's
    rows in order, so a FULL_STATE_DICT is a Hugging Face Mixtral one. Collective over the ep group; other
    tensors pass through."""
    if not is_expert_mesh(mesh):
        return local
    ep, _, group = _ep_peers()
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def own_experts(full: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This ep rank's rows of a full expert stack (loading a FULL_STATE_DICT); other tensors pass through."""
    if not is_expert_mesh(mesh):
        return full
    ep, rank, _ = _ep_peers()
    per = full.shape[0] // ep
    return full[rank * per : (rank + 1) * per]
