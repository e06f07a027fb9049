"""``smp.resume_from_checkpoint``: load a folder written by ``smp.save_checkpoint`` into this job.

The saved degrees must match this job's (other config differences only warn, as in SMP). A resume made
before the model or optimizer exists waits for them (``deferred_loads.py``).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smp_compat.checkpoints import deferred_loads
from smp_compat.checkpoints.folders import (
    CONFIG_FILE,
    SAVED_FP16_KEY,
    SAVED_OPTIMIZER_KEY,
    USER_CONTENT_FILE,
    check_tag,
    checkpoint_folder,
    fp16_file,
    model_file,
    optimizer_file,
    raise_if_any_failed,
)
from smp_compat.checkpoints.serialization import safe_load
from smp_compat.checkpoints.state_dicts import PART_OF_KEY
from smp_compat.errors import CheckpointError
from smp_compat.globalstate import state

__all__ = ["check_saved_config", "load_full_model_state", "resume_from_checkpoint"]

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
    saved = _agreed(folder, lambda: _load(config, weights_only, path) if config.is_file() else None)
    check_saved_config(saved, str(folder), resharding=sharded)
    files = _agreed(folder, lambda: _read_files(folder, path, saved, load_optimizer and not sharded, weights_only))
    if sharded:
        load_sharded(folder, load_optimizer, strict, weights_only, load_sharded_optimizer_state=load_moments)
    else:
        _apply(files.model, {"strict": strict}, files.optimizer, files.fp16)
    return files.user_content


@dataclass
class _Files:
    """What this rank read from a partial checkpoint folder (None: not there, or not asked for)."""

    model: Any = None
    optimizer: Any = None
    fp16: Any = None
    user_content: Any = None


def _agreed(folder: Path, read: Callable[[], Any]) -> Any:
    """``read()`` on every rank; when it fails anywhere, every rank raises the same error before going on to
    a load (a collective), so a rank whose file is bad never leaves the others waiting in it."""
    result, error = None, None
    try:
        result = read()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    raise_if_any_failed(error, f"Resuming checkpoint {str(folder)!r}", "Nothing was loaded on any rank.")
    return result


def _read_files(folder: Path, root: Any, saved: Any, load_optimizer: bool, weights_only: bool) -> _Files:
    """This rank's part files (model, optimizer, fp16 masters) and the user content; a missing part or a part
    written by another rank raises."""
    content = folder / USER_CONTENT_FILE
    files = _Files(user_content=_load(content, weights_only, root) if content.is_file() else None)
    coords = state.topology.coords(state.rank)
    pp, tp, rdp = coords.pp_rank, coords.tp_rank, coords.rdp_rank
    files.model = _load(folder / model_file(pp, tp), weights_only, root) if _check_parts(folder) else None
    if load_optimizer:  # with optimizer-state sharding, each rdp rank has files of its own
        names = (optimizer_file(pp, tp), optimizer_file(pp, tp, rdp))
        need = _saved_with(folder, saved, SAVED_OPTIMIZER_KEY, "optimizer_states_")
        files.optimizer = _own_part(*_load_part(folder, names, need, weights_only, root))
        names = (fp16_file(pp, tp), fp16_file(pp, tp, rdp))
        need = _saved_with(folder, saved, SAVED_FP16_KEY, "fp16_states_")
        files.fp16 = _load_part(folder, names, need, weights_only, root)[0]
    return files


def _saved_with(folder: Path, saved: Any, key: str, prefix: str) -> bool:
    """Whether the save wrote files ``prefix*`` (its config says so; older or re-cut folders: any such file)."""
    if isinstance(saved, Mapping) and key in saved:
        return bool(saved[key])
    return any(p.name.startswith(prefix) for p in folder.iterdir())


def _load_part(
    folder: Path, names: tuple[str, str], needed: bool, weights_only: bool, root: Any
) -> tuple[Any, Path | None]:
    """This rank's part (plain name, or per replica with optimizer-state sharding) and its path; (None, None)
    when the save wrote none. A part the save wrote but that is gone raises: the state would silently reset."""
    for name in names:
        if (folder / name).is_file():
            return _load(folder / name, weights_only, root), folder / name
    if not needed:
        return None, None
    expected = folder / names[1 if state.cfg.shard_optimizer_state else 0]
    raise CheckpointError(
        f"Checkpoint file {str(expected)!r} is missing: the checkpoint was saved with an optimizer, and this rank "
        "needs its part to resume it. Restore the file from a complete copy of the checkpoint, resume an older "
        "checkpoint, or pass load_optimizer=False to load the model only (the optimizer then starts afresh)."
    )


def _own_part(part: Any, path: Path | None) -> Any:
    """The optimizer part without its writer mark, after checking that this rank wrote it: a part copied over
    another's name would load as an empty state for this rank's parameters (the names do not match)."""
    if not isinstance(part, Mapping) or not isinstance(part.get(PART_OF_KEY), Mapping):
        return part
    writer = part[PART_OF_KEY]
    coords = state.topology.coords(state.rank)
    mine = {"pp_rank": coords.pp_rank, "tp_rank": coords.tp_rank}
    if writer.get("rdp_rank") is not None:
        mine["rdp_rank"] = coords.rdp_rank
    if any(writer.get(k) != v for k, v in mine.items()):
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} does not belong to this rank: it is the optimizer part of "
            f"{_coords(writer, mine)}, but this rank is {_coords(mine, mine)}. It was replaced by another rank's "
            "part (copied over the wrong name?). Restore it from a complete copy of the checkpoint, or pass "
            "load_optimizer=False."
        )
    return {k: v for k, v in part.items() if k != PART_OF_KEY}


def _coords(ranks: Mapping[str, Any], keys: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {ranks.get(k)}" for k in keys)


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


def load_full_model_state(model_sd: Any, strict: bool = True) -> None:
    """A full model state dict read by the caller, loaded (or queued) as ``resume_from_checkpoint(partial=False)``
    loads its file; the Hugging Face Trainer's safetensors checkpoints come this way (smp_compat/trainer)."""
    _apply(model_sd, {"strict": strict}, None, None)


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
    queued_fp16 = fp16_sd if optimizer is None else None  # applied by the fp16/bf16 optimizer once created
    deferred_loads.queue_resume(queued_model, queued_optimizer, queued_fp16)
