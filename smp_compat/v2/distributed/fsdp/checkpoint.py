"""``torch.sagemaker.distributed.fsdp.checkpoint``: SMP 2.0 - 2.3's model checkpoint helpers (deprecated in
SMP 2.6.1, removed in 2.7), which AWS's HyperPod scripts import at module top and call for
``--checkpoint_type use_pg_with_util``:

    save_model_checkpoint(model, StateDictType.SHARDED_STATE_DICT, save_dir, sharding_strategy,
                          (process_group, coordinator_rank, action_rank), log=rank == 0,
                          optimizer=optimizer, scheduler=scheduler, extra_exports={...})
    loaded = load_model_checkpoint(model, StateDictType.SHARDED_STATE_DICT, checkpoint_dir, sharding_strategy,
                                   (process_group, coordinator_rank, action_rank), log=rank == 0,
                                   optimizer=optimizer, scheduler=scheduler, extra_imports={key: default})
    model, optimizer = loaded[EXPORT_KEY_MODEL], loaded[EXPORT_KEY_OPTIMIZER]
    scheduler, counters = loaded[EXPORT_KEY_SCHEDULER], loaded[EXPORT_KEY_IDENTITY]

The checkpoint is the scripts' ``sharded`` one (docs/porting_v2.md, "Checkpoints"): one DCP folder holding
``model``, ``optimizer`` (keyed by parameter name), ``scheduler`` and the exported entries, written by the action
ranks (replica 0) over ``process_group`` with the global ``coordinator_rank``, and at tensor parallelism > 1 one
``tp{T}-{r}`` folder per tensor-parallel rank inside ``save_dir``. Either checkpoint type resumes the other's.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import StateDictType

from smp_compat.errors import CheckpointError, SMPUnsupportedError

__all__ = [
    "EXPORT_KEY_IDENTITY",
    "EXPORT_KEY_MODEL",
    "EXPORT_KEY_OPTIMIZER",
    "EXPORT_KEY_SCHEDULER",
    "IDENTITY_DEFAULTS",
    "load_model_checkpoint",
    "save_model_checkpoint",
]

EXPORT_KEY_MODEL = "model"
"""Where the checkpoint holds the model's state dict, and where ``load_model_checkpoint`` returns the model."""
EXPORT_KEY_OPTIMIZER = "optimizer"
EXPORT_KEY_SCHEDULER = "scheduler"
EXPORT_KEY_IDENTITY = "identity"
"""``load_model_checkpoint``'s entry for the ``extra_imports`` values read from the checkpoint."""

IDENTITY_DEFAULTS: dict[str, Any] = {"epoch": 0}
"""What the identity entry holds when the checkpoint does not: AWS's HyperPod scripts export three counters,
not ``epoch``, and read ``identity["epoch"]`` back after the load, so SMP's identity entry held an ``epoch`` of
its own, which it could only have defaulted; a script that exports ``epoch`` gets its saved value."""

_log = logging.getLogger("smp_compat.v2.checkpoint")
_RESERVED = (EXPORT_KEY_MODEL, EXPORT_KEY_OPTIMIZER, EXPORT_KEY_SCHEDULER)


def _check_type(state_dict_type: Any) -> None:
    if state_dict_type != StateDictType.SHARDED_STATE_DICT:
        raise SMPUnsupportedError(
            f"save/load_model_checkpoint with {state_dict_type}: smp_compat writes these helpers' checkpoints as "
            "StateDictType.SHARDED_STATE_DICT (what AWS's scripts pass); for a full model use FSDP's "
            "FULL_STATE_DICT with torch.save, as the scripts' --checkpoint_type full does."
        )


def _metadata(checkpointing_pg_metadata: Any) -> tuple[Any, int, bool]:
    """The scripts' ``(process_group, coordinator_rank, action_rank)``."""
    try:
        group, coordinator, action = checkpointing_pg_metadata
    except (TypeError, ValueError):
        raise CheckpointError(
            f"checkpointing_pg_metadata={checkpointing_pg_metadata!r}: expected (process_group, coordinator_rank, "
            "action_rank), as AWS's train_lib.py builds it"
        ) from None
    return group, int(coordinator), bool(action)


def _folder(path: str | os.PathLike[str]) -> str:
    """``path``, or its ``tp{T}-{r}`` folder at tensor parallelism > 1 (each tp rank's slices, as SMP's)."""
    from smp_compat.v2.state import state

    tp = state.tensor_parallel_degree if state.initialized else 1
    return os.path.join(os.fspath(path), f"tp{tp}-{state.tp_rank}") if tp > 1 else os.fspath(path)


def _check_exports(extra: dict[str, Any]) -> None:
    clash = sorted(set(extra) & set(_RESERVED))
    if clash:
        raise CheckpointError(f"extra exports/imports {clash} would replace the checkpoint's own entries {_RESERVED}")


def save_model_checkpoint(
    model: torch.nn.Module,
    state_dict_type: Any,
    path: str | os.PathLike[str],
    sharding_strategy: Any = None,
    checkpointing_pg_metadata: Any = None,
    log: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra_exports: dict[str, Any] | None = None,
) -> None:
    """Save the FSDP model (and optimizer, scheduler, ``extra_exports``) as a sharded checkpoint in ``path``.

    Every rank calls it (gathering the optimizer state is collective); the action ranks write.
    ``sharding_strategy`` is the model's own and is not needed to save it.
    """
    del sharding_strategy
    _check_type(state_dict_type)
    group, coordinator, action = _metadata(checkpointing_pg_metadata)
    extra = dict(extra_exports or {})
    _check_exports(extra)
    state: dict[str, Any] = {EXPORT_KEY_MODEL: get_model_state_dict(model)}
    if optimizer is not None:
        state[EXPORT_KEY_OPTIMIZER] = get_optimizer_state_dict(model, optimizer)
    if scheduler is not None:
        state[EXPORT_KEY_SCHEDULER] = scheduler.state_dict()
    state.update(extra)
    folder = _folder(path)
    if action:
        from smp_compat.v2.distributed.checkpoint.state_dict_saver import save

        save(state, storage_writer=dcp.FileSystemWriter(folder), planner=dcp.DefaultSavePlanner(),
             process_group=group, coordinator_rank=coordinator)  # fmt: skip
    if log:
        _log.info("save_model_checkpoint: wrote %s (%s)", folder, ", ".join(state))


def load_model_checkpoint(
    model: torch.nn.Module,
    state_dict_type: Any,
    path: str | os.PathLike[str],
    sharding_strategy: Any = None,
    checkpointing_pg_metadata: Any = None,
    log: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra_imports: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into the model (and optimizer, scheduler) in place; returns them under the
    ``EXPORT_KEY_*`` keys, with the ``extra_imports`` keys' saved values under ``EXPORT_KEY_IDENTITY`` (their
    given values are templates: a key the checkpoint lacks raises CheckpointError), and ``epoch`` 0 unless one
    was saved (``IDENTITY_DEFAULTS``)."""
    del sharding_strategy
    _check_type(state_dict_type)
    group, coordinator, _ = _metadata(checkpointing_pg_metadata)
    extra = dict(extra_imports or {})
    _check_exports(extra)
    folder = _folder(path)
    state: dict[str, Any] = {EXPORT_KEY_MODEL: get_model_state_dict(model), **extra}
    if scheduler is not None:
        state[EXPORT_KEY_SCHEDULER] = scheduler.state_dict()
    from smp_compat.v2.distributed.checkpoint.state_dict_loader import load

    load(state, storage_reader=dcp.FileSystemReader(folder), planner=dcp.DefaultLoadPlanner(), process_group=group,
         coordinator_rank=coordinator)  # fmt: skip
    model.load_state_dict(state[EXPORT_KEY_MODEL])
    if scheduler is not None:
        scheduler.load_state_dict(state[EXPORT_KEY_SCHEDULER])
    if optimizer is not None:
        _load_optimizer(model, optimizer, state[EXPORT_KEY_MODEL], folder, group)
    if log:
        _log.info("load_model_checkpoint: read %s", folder)
    identity = {**IDENTITY_DEFAULTS, **{key: state[key] for key in extra}}
    return {EXPORT_KEY_MODEL: model, EXPORT_KEY_OPTIMIZER: optimizer, EXPORT_KEY_SCHEDULER: scheduler,
            EXPORT_KEY_IDENTITY: identity}  # fmt: skip


def _load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                    folder: str, group: Any) -> None:  # fmt: skip
    """The optimizer state, read in each parameter's layout, as the scripts' sharded resume reads it."""
    from smp_compat.v2 import dcp_compat
    from smp_compat.v2.distributed.checkpoint.sharded_optim import holds_dtensors, load_for_dtensors

    if holds_dtensors(model_state):
        loaded = load_for_dtensors(model_state, EXPORT_KEY_OPTIMIZER, dcp.FileSystemReader(folder), process_group=group)
    else:
        dcp_compat.install()
        loaded = dcp_compat.STOCK["load_sharded_optimizer_state_dict"](model_state, EXPORT_KEY_OPTIMIZER,
                                                                       dcp.FileSystemReader(folder))  # fmt: skip
    set_optimizer_state_dict(model, optimizer, loaded[EXPORT_KEY_OPTIMIZER])
