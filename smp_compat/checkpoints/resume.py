"""``smp.resume_from_checkpoint``: load a folder written by ``smp.save_checkpoint`` into this job.

The saved degrees must match this job's (other config differences only warn, as in SMP). A resume made
before the model or optimizer exists waits for them (``deferred_loads.py``).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from smp_compat.checkpoints import deferred_loads
from smp_compat.checkpoints.folders import (
    CONFIG_FILE,
    USER_CONTENT_FILE,
    check_tag,
    checkpoint_folder,
    fp16_file,
    model_file,
    optimizer_file,
)
from smp_compat.checkpoints.serialization import safe_load
from smp_compat.errors import CheckpointError
from smp_compat.globalstate import state

__all__ = ["check_saved_config", "resume_from_checkpoint"]

_MUST_MATCH = ("pipeline_parallel_degree", "tensor_parallel_degree", "shard_optimizer_state",
               "sharded_data_parallel_degree")  # fmt: skip
_MAY_DIFFER = {"microbatches", "active_microbatches", "pipeline", "ddp_port", "ddp_dist_backend", "placement_strategy"}


def check_saved_config(saved: Any, where: str, resharding: bool = False) -> None:
    """Degrees that decide the parts must match this job; other differences only warn (as SMP).

    ``resharding``: a sharded (DCP) checkpoint, which loads at any sharded_data_parallel_degree.
    """
    if not isinstance(saved, Mapping):
        return
    values = dict(saved.get("config") or {})
    values.update({k: saved[k] for k in _MUST_MATCH if k in saved})
    current = state.cfg.to_dict()
    must_match = [k for k in _MUST_MATCH if not (resharding and k == "sharded_data_parallel_degree")]
    bad = [k for k in must_match if k in values and values[k] != current.get(k)]
    if bad:
        changes = ", ".join(f"{k}: saved {values[k]!r}, now {current.get(k)!r}" for k in bad)
        raise CheckpointError(
            f"Checkpoint {where} cannot be resumed by this job: {changes}. A partial checkpoint's parts follow "
            "the layout it was saved with. Resume with the same degrees, re-cut it for this job's degrees with "
            "`smp-compat checkpoint split <checkpoint> --pp P --tp T -o <dir>`, or merge it into one state dict "
            "with `smp-compat checkpoint merge` and load that with model.load_state_dict()."
        )
    differ = sorted(k for k in values if k in current and k not in _MUST_MATCH and k not in _MAY_DIFFER
                    and values[k] != current[k])  # fmt: skip
    if differ:
        warnings.warn(f"Checkpoint {where} was saved with a different config for {differ}.", stacklevel=3)


def _check_parts(folder: Path) -> bool:
    """The model part files must be one per (pp, tp) of this job; returns False when the checkpoint has none."""
    pattern = re.compile(r"^model_(\d+)_(\d+)\.pt$")
    found = {tuple(int(g) for g in m.groups()) for p in folder.iterdir() if (m := pattern.match(p.name))}
    if not found:
        return False
    topo = state.topology
    expected = {(p, t) for p in range(topo.pp_size) for t in range(topo.tp_size)}
    if found != expected:
        raise CheckpointError(
            f"Checkpoint {str(folder)!r} has model parts {sorted(found)} but this job (pipeline_parallel_degree="
            f"{topo.pp_size}, tensor_parallel_degree={topo.tp_size}) needs {sorted(expected)}. Resume with the "
            "degrees it was saved with, re-cut it with `smp-compat checkpoint split <checkpoint> --pp "
            f"{topo.pp_size} --tp {topo.tp_size} -o <dir>`, or merge it with `smp-compat checkpoint merge`."
        )
    return True


def resume_from_checkpoint(
    path: str | os.PathLike[str],
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    weights_only: bool = True,
    load_optimizer_states: bool | None = None,
) -> Any:
    """Load a checkpoint on every rank and return its ``user_content``.

    Works before or after wrapping: loads whose model or optimizer does not exist yet are queued and
    applied when it is created, and like every load they wait for partitioning. Files load with
    ``weights_only=True`` (plus harmless types such as argparse.Namespace and numpy scalars) unless the
    folder is trusted (``SMP_COMPAT_TRUST_CHECKPOINTS``, ``smp-compat run --trust-checkpoint``) or
    ``weights_only=False`` is passed.
    """
    state.require_init("smp.resume_from_checkpoint")
    if load_optimizer_states is not None:  # SMP 1.10's name
        load_optimizer = load_optimizer_states
    if partial:
        return _resume_partial(path, tag, strict, load_optimizer, weights_only, load_sharded_optimizer_state)
    return _resume_full(path, tag, strict, translate_function, weights_only)


def _load(file: Path, weights_only: bool, root: Any) -> Any:
    """A checkpoint file; a refusal names ``root`` (the path given to resume) as the folder to trust."""
    return safe_load(file, map_location="cpu", weights_only=weights_only, trust_folder=root)


def _resume_partial(
    path: Any, tag: str | None, strict: bool, load_optimizer: bool, weights_only: bool, load_moments: bool = True
) -> Any:
    from smp_compat.sdp.checkpoint import is_sharded_checkpoint, load_sharded

    folder = checkpoint_folder(path, tag)
    config = folder / CONFIG_FILE
    sharded = is_sharded_checkpoint(folder)
    if config.is_file():
        check_saved_config(_load(config, weights_only, path), str(folder), resharding=sharded)
    content = folder / USER_CONTENT_FILE
    if sharded:
        load_sharded(folder, load_optimizer, strict, weights_only, load_sharded_optimizer_state=load_moments)
        return _load(content, weights_only, path) if content.is_file() else None
    coords = state.topology.coords(state.rank)
    pp, tp = coords.pp_rank, coords.tp_rank
    model_sd = _load(folder / model_file(pp, tp), weights_only, path) if _check_parts(folder) else None
    optimizer_sd = fp16_sd = None
    if load_optimizer:  # with optimizer-state sharding, each rdp rank has files of its own
        rdp = coords.rdp_rank
        optimizer_names = (optimizer_file(pp, tp), optimizer_file(pp, tp, rdp))
        optimizer_sd = _load_first(folder, optimizer_names, weights_only, path)
        fp16_sd = _load_first(folder, (fp16_file(pp, tp), fp16_file(pp, tp, rdp)), weights_only, path)
    user_content = _load(content, weights_only, path) if content.is_file() else None
    _apply(model_sd, {"strict": strict}, optimizer_sd, fp16_sd)
    return user_content


def _load_first(folder: Path, names: tuple[str, ...], weights_only: bool, root: Any) -> Any:
    """The first of ``names`` that exists in ``folder``, loaded; None when none does."""
    for name in names:
        if (folder / name).is_file():
            return _load(folder / name, weights_only, root)
    return None


def _resume_full(
    path: Any, tag: str | None, strict: bool, translate: Callable[..., Any] | None, weights_only: bool
) -> Any:
    if tag is None:
        raise CheckpointError(
            "resume_from_checkpoint(partial=False) needs the tag of the full checkpoint (`newest` lists partial "
            "checkpoints only). Pass tag=... as given to smp.save_checkpoint."
        )
    root = Path(path)
    target = root / check_tag(tag)
    if not target.is_file():
        raise CheckpointError(
            f"Full checkpoint file {str(target)!r} does not exist. Pass the path and tag given to "
            "smp.save_checkpoint(partial=False)."
        )
    model_sd = _load(target, weights_only, path)
    content = root / f"user_content_{tag}"
    user_content = _load(content, weights_only, path) if content.is_file() else None
    _apply(model_sd, {"strict": strict, "translate_function": translate}, None, None)
    return user_content


def _apply(model_sd: Any, model_kwargs: dict[str, Any], optimizer_sd: Any, fp16_sd: Any) -> None:
    """Load into what exists now; queue what does not exist yet (created later, then partitioned)."""
    model, optimizer = state.model, state.optimizer
    queued_model = None
    if model_sd is not None:
        if model is not None:
            model.load_state_dict(model_sd, **model_kwargs)
        else:
            queued_model = {"state_dict": model_sd, **model_kwargs}
    queued_optimizer = None
    if optimizer_sd is not None:
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_sd)
        else:
            queued_optimizer = optimizer_sd
    load_fp16 = getattr(optimizer, "load_local_fp16_state_dict", None)
    if fp16_sd is not None and callable(load_fp16):
        load_fp16(fp16_sd)
    deferred_loads.queue_resume(queued_model, queued_optimizer)
