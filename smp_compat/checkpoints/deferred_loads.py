"""Loads that wait: a resume made before the model or optimizer exists, and loads made before partitioning.

SMP let ``smp.resume_from_checkpoint`` run before ``smp.DistributedModel`` and a partial load run before
the first step; both are kept here and applied when the model is partitioned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smp_compat.checkpoints.state_dicts import LOAD_INFO_KEY, is_partial, PendingModelLoad, apply_model_load
from smp_compat.globalstate import state

__all__ = [
    "apply_pending_model_loads",
    "attach_queued_fp16_load",
    "attach_queued_optimizer_load",
    "queue_resume",
    "saved_partition",
]


_QUEUED: dict[str, Any] = {}


def queue_resume(
    model_load: dict[str, Any] | None, optimizer_sd: Mapping[str, Any] | None, fp16_sd: Mapping[str, Any] | None = None
) -> None:
    """Remember a resume made before the model/optimizer exist; applied when they are created/partitioned.

    ``model_load`` holds the keyword arguments of ``model.load_state_dict``; ``fp16_sd`` is the fp16_states part
    (loss scaler, fp32 masters), which needs the fp16/bf16 optimizer and is applied after its masters exist.
    """
    _QUEUED.clear()
    _QUEUED.update(launch=state.launch, model=model_load, optimizer=optimizer_sd, fp16=fp16_sd)


def _take_queued(kind: str) -> Any:
    if _QUEUED.get("launch") is not state.launch:
        _QUEUED.clear()
        return None
    return _QUEUED.pop(kind, None)


def saved_partition(model: Any) -> dict[str, int] | None:
    """The module-to-rank assignment of a partial load waiting for partitioning, when it may be reused.

    SMP partitions a model that is about to load a partial checkpoint the way the checkpoint was
    saved (``same_partition_load``); the partitioner can call this to do the same. Without it the
    load is still correct: parts saved under another partition are merged.
    """
    candidates = []
    pending = getattr(model, "_pending_state_dict", None)
    if isinstance(pending, PendingModelLoad) and pending.same_partition_load:
        candidates.append(pending.state_dict)
    queued = _QUEUED.get("model") if _QUEUED.get("launch") is state.launch else None
    if queued is not None:
        candidates.append(queued["state_dict"])
    for sd in candidates:
        info = sd.get(LOAD_INFO_KEY) if is_partial(sd) else None
        partition = info.get("partition_info") if isinstance(info, Mapping) else None
        if isinstance(partition, Mapping) and info.get("pipeline_parallel_degree") == state.topology.pp_size:
            assignment = partition.get("assignment")
            if isinstance(assignment, Mapping):
                return {str(k): int(v) for k, v in assignment.items()}
    return None


def attach_queued_optimizer_load(optimizer: torch.optim.Optimizer) -> None:
    """A resume made before ``DistributedOptimizer``: load its optimizer part now (or when partitioned)."""
    queued = _take_queued("optimizer")
    if queued is not None:
        optimizer.load_state_dict(queued)


def attach_queued_fp16_load(optimizer: Any) -> None:
    """A resume made before ``DistributedOptimizer``: its fp16_states part goes to the fp16/bf16 optimizer,
    which applies it once its masters exist (after the model load, so the masters are the saved ones)."""
    queued = _take_queued("fp16")
    load = getattr(optimizer, "load_local_fp16_state_dict", None)
    if queued is not None and callable(load):
        load(queued)


def apply_pending_model_loads(model: Any) -> None:
    """After partitioning, before fp16 masters are copied from the weights: a queued resume, a deferred load."""
    queued = _take_queued("model")
    if queued is not None:
        model.load_state_dict(**queued)
    pending, model._pending_state_dict = model._pending_state_dict, None
    if pending is not None:
        apply_model_load(model, pending)
