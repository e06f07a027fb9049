"""Sharded checkpoints: ``smp.save_checkpoint(partial=True)`` under sharded DP writes torch DCP.

The files go into SMP's ``<tag>_partial/`` folder through the same staging-then-rename publication
as every partial checkpoint (checkpoints/folders.py), so a kill during a save loses nothing. Inside: DCP's
``.metadata`` and one ``__<rank>_0.distcp`` per rank (model and optimizer shards, keyed by parameter
name), ``fp16_states.pt`` (the loss scaler), plus the usual ``user_content.pt`` and ``smp_config.pt``.
DCP reshards on load, so a checkpoint saved at one ``sharded_data_parallel_degree`` resumes at another
(SMP could not). ``smp-compat checkpoint merge`` turns the folder into one plain state dict. With tensor
parallelism each tp rank's slices are saved under tp-tagged names (tp_checkpoint.py).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from smp_compat.errors import CheckpointError
from smp_compat.globalstate import state
from smp_compat.sdp.state_dicts import attach_ds_views
from smp_compat.sdp.tp_checkpoint import join_tp_slices, tag_tp_slices, untag_tp_slices, write_layout
from smp_compat.checkpoints.serialization import atomic_save, safe_load

__all__ = ["is_sharded_checkpoint", "write_sharded", "load_sharded", "merge_sharded", "FP16_STATES"]

METADATA = ".metadata"
FP16_STATES = "fp16_states.pt"


def is_sharded_checkpoint(folder: Path) -> bool:
    """A partial folder written under sharded DP (DCP's metadata file is there)."""
    return (Path(folder) / METADATA).is_file()


def _optimizer_of(optimizer: Any) -> torch.optim.Optimizer | None:
    return getattr(optimizer, "optimizer", optimizer)


def write_sharded(staging: Path, model: Any, optimizer: Any) -> None:
    """Every rank: its shards through DCP (collective); rank 0 also the loss-scaler state."""
    if model is None:
        raise CheckpointError(
            "smp.save_checkpoint under sharded data parallelism needs model=... (the optimizer state is keyed by "
            "the model's parameter names)."
        )
    content: dict[str, Any] = {"model": get_model_state_dict(model.module)}
    if optimizer is not None:
        content["optim"] = get_optimizer_state_dict(model.module, _optimizer_of(optimizer))
    dcp.save(tag_tp_slices(content, model.module), checkpoint_id=str(staging))
    write_layout(staging, model.module)
    fp16_states = getattr(optimizer, "local_fp16_state_dict", None)
    if state.rank == 0 and callable(fp16_states):
        atomic_save(fp16_states(), Path(staging) / FP16_STATES)


def load_sharded(
    folder: Path, load_optimizer: bool, strict: bool, weights_only: bool, load_sharded_optimizer_state: bool = True
) -> None:
    """Every rank: read the shards this job's layout needs (any saved sdp degree) into model and optimizer.

    ``load_sharded_optimizer_state=False`` (SMP's sharded-DP option) restores the weights and the fp16
    loss-scaler state but not the optimizer's moments.
    """
    model, optimizer = state.model, state.optimizer
    if model is None or getattr(model, "_sdp_units", None) is None:
        raise CheckpointError(
            f"{folder} is a sharded-data-parallel checkpoint (DCP). Resume it after smp.DistributedModel(...) in a job "
            "with sharded_data_parallel_degree > 1 (any degree), or merge it into one plain state dict with "
            "`smp-compat checkpoint merge` and load that with model.load_state_dict()."
        )
    if load_optimizer and optimizer is None:
        raise CheckpointError(
            "resume_from_checkpoint(load_optimizer=True) of a sharded checkpoint needs the optimizer: call it after "
            "smp.DistributedOptimizer(...), or pass load_optimizer=False."
        )
    content: dict[str, Any] = {"model": get_model_state_dict(model.module)}
    inner = _optimizer_of(optimizer)
    moments = load_optimizer and load_sharded_optimizer_state
    if moments:
        content["optim"] = get_optimizer_state_dict(model.module, inner)
    tagged = tag_tp_slices(content, model.module)
    if moments:
        tagged["optim"] = _without_stateless(tagged["optim"], folder)
    dcp.load(tagged, checkpoint_id=str(folder), planner=DefaultLoadPlanner(allow_partial_load=not strict))
    content = untag_tp_slices(tagged, model.module)
    set_model_state_dict(model.module, content["model"])
    if moments:  # not strict: the state-less parameters left out above (dcp.load checked every other key)
        set_optimizer_state_dict(model.module, inner, content["optim"], options=StateDictOptions(strict=False))
    if load_optimizer:
        fp16 = Path(folder) / FP16_STATES
        load_fp16 = getattr(optimizer, "load_local_fp16_state_dict", None)
        if fp16.is_file() and callable(load_fp16):
            load_fp16(safe_load(fp16, map_location="cpu", weights_only=weights_only))
    attach_ds_views(model.module)


def _without_stateless(optim: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The optimizer state to read, less the parameters the checkpoint has no state for.

    A parameter that never had a gradient (a module the forward skips) has no optimizer state, so the
    save wrote none; torch's ``get_optimizer_state_dict`` still gives the fresh optimizer an entry for every
    parameter. Such a parameter stays state-less after the resume, as with plain PyTorch's
    ``optimizer.load_state_dict``. A parameter with some of its entries saved is kept: a missing one still fails.
    """
    saved = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    state = {
        name: entry for name, entry in optim["state"].items()
        if any(f"optim.state.{name}.{key}" in saved for key in entry)
    }  # fmt: skip
    return {**optim, "state": state}


def merge_sharded(folder: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Offline, no process group: (full model state dict, full optimizer state dict or None)."""
    with tempfile.TemporaryDirectory(prefix="smp_merge_") as tmp:
        out = Path(tmp) / "merged.pt"
        dcp_to_torch_save(str(folder), str(out))
        merged = torch.load(out, map_location="cpu", weights_only=True)
    return join_tp_slices(folder, dict(merged.get("model", {})), merged.get("optim"))
