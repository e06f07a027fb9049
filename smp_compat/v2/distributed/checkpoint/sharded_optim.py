"""Load a sharded optimizer state saved by DCP into the DTensor layout of an FSDP2-backed model.

Stock ``load_sharded_optimizer_state_dict`` builds FSDP1 ShardedTensors from the model's state dict and
cannot read the DTensors the FSDP2-backed model has (on CPU it even divides by the GPU count). Every
optimizer state that has the shape of its parameter is sharded like it, so the load template here is the
checkpoint's metadata (names, sizes, dtypes) laid out on each parameter's own mesh and placements; DCP then
reads exactly this rank's pieces, whatever the layout that saved them (another hybrid shard degree too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from smp_compat.errors import CheckpointError
from smp_compat.v2.distributed.checkpoint.group_view import copy_back, group_shape, localize

__all__ = ["holds_dtensors", "load_for_dtensors"]

_BYTES_PLACEHOLDER = "<bytes_io>"  # replaced by the stored object on load, as stock does


def holds_dtensors(state_dict: Mapping[str, Any]) -> bool:
    """Whether any value of a (flat, FQN-keyed) model state dict is a DTensor."""
    return any(isinstance(v, DTensor) for v in state_dict.values())


def _target(key: str, path: tuple[Any, ...], md: TensorStorageMetadata, model_sd: Mapping[str, Any],
            process_group: Any) -> torch.Tensor:  # fmt: skip
    """An empty tensor to read ``key`` into: sharded like its parameter when it has the parameter's shape."""
    like = model_sd.get(path[2]) if len(path) > 3 and path[1] == "state" else None
    dtype = md.properties.dtype
    if isinstance(like, DTensor) and tuple(group_shape(like, process_group)) == tuple(md.size):
        return torch.empty_like(like, dtype=dtype)
    if isinstance(like, torch.Tensor) and not isinstance(like, DTensor) and tuple(like.shape) == tuple(md.size):
        return torch.empty(md.size, dtype=dtype, device=like.device)
    if md.size.numel() > 1 and like is None and len(path) > 3 and path[1] == "state":
        raise CheckpointError(
            f"Optimizer state {key!r} is for parameter {path[2]!r}, which the model's state dict does not have; "
            "the checkpoint was saved from another model."
        )
    return torch.empty(md.size, dtype=dtype)  # scalars (Adam's step) and states not shaped like their parameter


def load_for_dtensors(
    model_state_dict: Mapping[str, Any],
    optimizer_key: str,
    storage_reader: Any,
    planner: Any = None,
    process_group: Any = None,
) -> dict[str, Any]:
    """``{optimizer_key: optimizer state dict}`` read from the checkpoint, laid out like the model's DTensors.

    The result is keyed by parameter FQN (``state``/``param_groups``), as FSDP's optim_state_dict makes it.
    """
    metadata = storage_reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(metadata.planner_data[key])
        if path[0] != optimizer_key:
            continue
        if isinstance(md, BytesStorageMetadata):
            flat[key] = _BYTES_PLACEHOLDER
        else:
            flat[key] = _target(key, path, md, model_state_dict, process_group)
    if not flat:
        raise CheckpointError(f"The checkpoint has no entry under {optimizer_key!r} (no optimizer state was saved).")
    view = localize(flat, process_group)
    dcp.load(view, storage_reader=storage_reader, planner=planner, process_group=process_group)
    copy_back(flat, view)
    return unflatten_state_dict(flat, {k: metadata.planner_data[k] for k in flat})
