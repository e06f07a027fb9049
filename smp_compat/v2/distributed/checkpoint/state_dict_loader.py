"""``torch.sagemaker.distributed.checkpoint.state_dict_loader``: SMP v2's ``load`` (DCP's, with its arguments).

``coordinator_rank`` is a global rank of ``process_group`` (translated for DCP). ``check_keys_matched``
compares the keys every rank of the group asks for before reading, so ranks that built different state
dicts get one clear error instead of a hang or a half-loaded model.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from smp_compat.errors import CheckpointError
from smp_compat.v2.dcp_compat import STOCK, group_rank, install
from smp_compat.v2.distributed.checkpoint.group_view import copy_back, localize

__all__ = ["load"]


def _check_keys_matched(state_dict: dict[str, Any], process_group: Any) -> None:
    keys = sorted(flatten_state_dict(state_dict)[0])
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, keys, group=process_group)
    for rank, other in enumerate(gathered):
        if other != keys:
            missing, extra = sorted(set(other) - set(keys))[:5], sorted(set(keys) - set(other))[:5]
            raise CheckpointError(
                f"Ranks load different state dicts: group rank {rank} asks for keys this rank lacks {missing} "
                f"and lacks {extra}. Every rank of the process group must build the same state dict."
            )


def load(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: Any = None,
    planner: Any = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    check_keys_matched: bool = True,
    **_: Any,
) -> None:
    """Read ``state_dict`` in place from the checkpoint (tensors copied into, other values replaced)."""
    if dist.is_initialized() and check_keys_matched:
        _check_keys_matched(state_dict, process_group)
    if storage_reader is None:
        if checkpoint_id is None:
            raise CheckpointError("load() needs a storage_reader or a checkpoint_id (the checkpoint's folder).")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    install()
    view = localize(state_dict, process_group)
    STOCK["load_state_dict"](view, storage_reader=storage_reader, planner=planner, process_group=process_group,
                             coordinator_rank=group_rank(process_group, coordinator_rank))  # fmt: skip
    copy_back(state_dict, view)
