"""Show DCP a state dict as the checkpoint's process group holds it: TP-local tensors in a ``tp{T}-{r}`` folder.

SMP v2 scripts save a sharded checkpoint over the FSDP shard group only, one folder per tensor-parallel
rank: each folder holds that TP rank's slices as whole tensors (SMP's TP modules keep local parameters).
Here TP parameters are DTensors over the whole (rep, shard, tp) mesh, so DCP would see every folder cover
only part of each tensor and refuse the plan. ``localize`` re-describes each such DTensor on the mesh dims
the group spans, with the shape of the slice the group holds; the local tensor is the same object, so a
load into the view fills the model's own tensor. A ``_StridedShard`` (FSDP2's shard of a TP slice) is
then a plain ``Shard`` of that slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from smp_compat.errors import CheckpointError

__all__ = ["localize", "copy_back", "needs_localizing", "group_shape"]


def _group_ranks(process_group: Any) -> set[int]:
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return set(range(dist.get_world_size()))
    return set(dist.get_process_group_ranks(process_group))


def _outside_dims(t: DTensor, members: set[int]) -> list[int]:
    """Mesh dims along which some of this rank's peers are not in the group."""
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return []
    outside = []
    for dim in range(mesh.ndim):
        index = tuple(slice(None) if d == dim else c for d, c in enumerate(coord))
        if not set(mesh.mesh[index].flatten().tolist()) <= members:
            outside.append(dim)
    return outside


def _is_split(p: Placement) -> bool:
    return isinstance(p, (Shard, _StridedShard))


def needs_localizing(t: Any, members: set[int]) -> bool:
    """A DTensor split along a mesh dim the group does not span (the group holds only a slice of it)."""
    return isinstance(t, DTensor) and any(_is_split(t.placements[d]) for d in _outside_dims(t, members))


def _chunk(size: int, parts: int, index: int) -> int:
    """The length of torch.chunk's ``index``-th piece of ``size`` in ``parts`` (DTensor's split rule)."""
    step = -(-size // parts)
    return max(0, min(size, step * (index + 1)) - step * index)


def _view(t: DTensor, members: set[int]) -> torch.Tensor:
    """``t`` on the dims the group spans, its shape that of the slice held by the group. A group of this rank
    alone (async_local's replication group when nothing is replicated, e.g. ep 2 at hsd 4 on 4 ranks) holds
    this rank's piece: the local tensor itself."""
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    outside = _outside_dims(t, members)
    inside = [d for d in range(mesh.ndim) if d not in outside]
    if not inside and members == {dist.get_rank()}:
        return t.to_local()
    if mesh.mesh_dim_names is None or not inside:
        raise CheckpointError(
            f"Cannot save a DTensor over a process group that spans none of its mesh dims (mesh {mesh}); "
            "pass the FSDP model's process group."
        )
    shape = list(t.shape)
    split_outside: dict[int, int] = {}  # tensor dim -> the last mesh dim outside the group that splits it
    for d in outside:
        p = t.placements[d]
        if _is_split(p):
            shape[p.dim] = _chunk(shape[p.dim], mesh.size(d), coord[d])  # type: ignore[attr-defined]
            split_outside[p.dim] = d  # type: ignore[attr-defined]
    placements: list[Placement] = []
    for d in inside:
        p = t.placements[d]
        if _is_split(p):
            dim = p.dim  # type: ignore[attr-defined]
            # a plain Shard applied before an outside split leaves the group strided pieces, not one slice
            if type(p) is Shard and split_outside.get(dim, -1) > d:
                raise CheckpointError(f"Unsupported DTensor layout for a group checkpoint: {t.placements}.")
            p = Shard(dim)
        elif not isinstance(p, Replicate):
            raise CheckpointError(f"Unsupported DTensor placement for a group checkpoint: {p}.")
        placements.append(p)
    names = tuple(mesh.mesh_dim_names[d] for d in inside)
    sub = mesh[names[0]] if len(names) == 1 else mesh[names]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t.to_local(), sub, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def group_shape(t: DTensor, process_group: Any) -> torch.Size:
    """The shape DCP sees for ``t`` in a checkpoint over ``process_group`` (the slice the group holds)."""
    members = _group_ranks(process_group)
    return _view(t, members).shape if needs_localizing(t, members) else t.shape


def _mirror(obj: Any, members: set[int]) -> Any:
    if isinstance(obj, Mapping):
        return {k: _mirror(v, members) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mirror(v, members) for v in obj]
    return _view(obj, members) if needs_localizing(obj, members) else obj


def _any_needs(obj: Any, members: set[int]) -> bool:
    if isinstance(obj, Mapping):
        return any(_any_needs(v, members) for v in obj.values())
    if isinstance(obj, list):
        return any(_any_needs(v, members) for v in obj)
    return needs_localizing(obj, members)


def localize(state_dict: dict[str, Any], process_group: Any) -> dict[str, Any]:
    """``state_dict`` itself when the group holds whole tensors, else a copy whose DTensors are the group's views."""
    members = _group_ranks(process_group)
    return _mirror(state_dict, members) if _any_needs(state_dict, members) else state_dict


def copy_back(original: Any, loaded: Any) -> None:
    """Put the values DCP replaced in ``loaded`` (a ``localize`` copy) back into ``original``; tensors were shared."""
    if original is loaded:
        return
    keys = original.keys() if isinstance(original, Mapping) else range(len(original))
    for k in keys:
        old, new = original[k], loaded[k]
        if isinstance(old, torch.Tensor):
            continue
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            copy_back(old, new)
        elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new) and _holds_tensors(old):
            copy_back(old, new)
        else:
            original[k] = new


def _holds_tensors(obj: Any) -> bool:
    if isinstance(obj, Mapping):
        return any(_holds_tensors(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_holds_tensors(v) for v in obj)
    return isinstance(obj, torch.Tensor)
