"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: SMP's checkpoint folders, written atomically.

A partial checkpoint is written into a hidden staging folder by every rank, and published by global
rank 0 with renames only after every rank has finished: a process killed during a save never
damages the previous checkpoint or the ``newest`` pointer, which is itself replaced atomically.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from smp_compat import state_dicts
from smp_compat.errors import CheckpointError
from smp_compat.globalstate import process_group, state
from smp_compat.serialization import atomic_save, atomic_write, fsync_dir, safe_load
from smp_compat.serialize import all_gather_objects, broadcast_object

__all__ = [
    "save_checkpoint",
    "resume_from_checkpoint",
    "NEWEST_FILE",
    "PARTIAL_SUFFIX",
    "CONFIG_FILE",
    "USER_CONTENT_FILE",
    "model_file",
    "optimizer_file",
    "fp16_file",
    "read_newest",
    "write_newest",
    "checkpoint_folder",
    "check_saved_config",
    "recover_interrupted",
    "publish_folder",
    "staging_folder",
]

NEWEST_FILE = "newest"
PARTIAL_SUFFIX = "_partial"
CONFIG_FILE = "smp_config.pt"
USER_CONTENT_FILE = "user_content.pt"
_STAGING = ".tmp-"
_BACKUP = ".old-"
_TRASH = ".trash-"
_MUST_MATCH = ("pipeline_parallel_degree", "tensor_parallel_degree", "shard_optimizer_state",
               "sharded_data_parallel_degree")  # fmt: skip
_MAY_DIFFER = {"microbatches", "active_microbatches", "pipeline", "ddp_port", "ddp_dist_backend", "placement_strategy"}


# ---------------------------------------------------------------------- names
def model_file(pp_rank: int, tp_rank: int) -> str:
    return f"model_{pp_rank}_{tp_rank}.pt"


def optimizer_file(pp_rank: int, tp_rank: int, rdp_rank: int | None = None) -> str:
    """``optimizer_states_<pp>_<tp>.pt``; with optimizer-state sharding every rdp rank has ``..._<rdp>.pt``."""
    suffix = f"_{rdp_rank}" if rdp_rank is not None else ""
    return f"optimizer_states_{pp_rank}_{tp_rank}{suffix}.pt"


def fp16_file(pp_rank: int, tp_rank: int) -> str:
    return f"fp16_states_{pp_rank}_{tp_rank}.pt"


def _check_tag(tag: Any) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or "\\" in tag or tag.startswith("."):
        raise CheckpointError(
            f"The checkpoint tag must be a non-empty name without path separators or a leading dot, got {tag!r}. "
            "Use something like tag=f'step_{step}'."
        )
    return tag


# ---------------------------------------------------------------------- the newest file
def read_newest(path: str | os.PathLike[str]) -> list[str]:
    """The folder names listed in ``<path>/newest``, oldest first (empty when there is none)."""
    target = Path(path) / NEWEST_FILE
    if not target.is_file():
        return []
    return [line.strip() for line in target.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_newest(path: str | os.PathLike[str], names: list[str]) -> None:
    """Replace ``<path>/newest`` atomically: readers see the old list or the new one, never a mix."""
    text = "".join(f"{n}\n" for n in names).encode("utf-8")
    atomic_write(Path(path) / NEWEST_FILE, lambda handle: handle.write(text))


# ---------------------------------------------------------------------- collectives over the world
def _all_gather(obj: Any) -> list[Any]:
    if state.world_size == 1:
        return [obj]
    device = state.device if state.backend == "nccl" else torch.device("cpu")
    return all_gather_objects(obj, process_group("world"), state.world_size, device)


def _from_rank0(obj: Any) -> Any:
    if state.world_size == 1:
        return obj
    device = state.device if state.backend == "nccl" else torch.device("cpu")
    return broadcast_object(obj, 0, process_group("world"), device)


def _agree_on_tag(tag: str) -> None:
    tags = _all_gather(tag)
    if len(set(tags)) > 1:
        by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise CheckpointError(
            f"smp.save_checkpoint was called with different tags on different ranks ({by_rank}). Every rank "
            "must pass the same tag, e.g. derived from the step counter rather than from time or rank."
        )


def _raise_if_any_failed(error: str | None, what: str) -> None:
    errors = _all_gather(error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        listing = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CheckpointError(f"{what} failed ({listing}). The previous checkpoint and `newest` are unchanged.")


# ---------------------------------------------------------------------- saving
def save_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    partial: bool = True,
    model: Any = None,
    optimizer: Any = None,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
) -> None:
    """Save a checkpoint on every rank (SMP §4.9 layout); returns when every rank's files are published.

    ``partial=True``: ``<path>/<tag>_partial/`` with per-rank model and optimizer files, the user
    content and the config, then ``newest``. ``partial=False``: ``<path>/<tag>`` (the full model
    only, plain PyTorch names) and ``<path>/user_content_<tag>``.
    """
    state.require_init("smp.save_checkpoint")
    tag = _check_tag(tag)
    if num_kept_partial_checkpoints is not None and (
        isinstance(num_kept_partial_checkpoints, bool)
        or not isinstance(num_kept_partial_checkpoints, int)
        or num_kept_partial_checkpoints < 1
    ):
        raise CheckpointError(
            f"num_kept_partial_checkpoints must be a positive int or None, got {num_kept_partial_checkpoints!r}."
        )
    _agree_on_tag(tag)
    root = Path(path)
    if partial:
        _save_partial(root, tag, model, optimizer, user_content, num_kept_partial_checkpoints)
    else:
        _save_full(root, tag, model, optimizer, user_content, translate_if_full)


def _writes_model_parts() -> bool:
    """One copy per (pp, tp) shard: the replicas with rdp_rank 0 write it (SMP's rule)."""
    return state.topology.coords(state.rank).rdp_rank == 0


def _save_partial(root: Path, tag: str, model: Any, optimizer: Any, user_content: Any, keep: int | None) -> None:
    """Every rank writes into rank 0's staging folder; rank 0 publishes it once all have succeeded."""
    name = f"{tag}{PARTIAL_SUFFIX}"
    staging_name, error = _from_rank0(_prepare_staging(root, name) if state.rank == 0 else None)
    if error:
        raise CheckpointError(f"smp.save_checkpoint: {error}. Check that the path is writable on rank 0.")
    staging = root / staging_name
    error = None
    try:
        _write_rank_files(staging, tag, model, optimizer, user_content)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others would publish
        error = f"{type(exc).__name__}: {exc}"
    try:
        _raise_if_any_failed(error, f"Writing checkpoint {name!r} in {root}")
    except CheckpointError:
        if state.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    error = None
    if state.rank == 0:
        try:
            publish_folder(root, staging, name, keep)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    _raise_if_any_failed(error, f"Publishing checkpoint {name!r} in {root}")


def _prepare_staging(root: Path, name: str) -> tuple[str | None, str | None]:
    """Rank 0: clean up after killed saves, then make the staging folder; (its name, or an error)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        recover_interrupted(root)
        return staging_folder(root, name).name, None
    except OSError as exc:
        return None, f"cannot prepare {root}: {exc}"


def staging_folder(root: Path, name: str) -> Path:
    """A new hidden folder beside ``<root>/<name>`` to write a checkpoint into before publishing it."""
    staging = root / f".{name}{_STAGING}{uuid.uuid4().hex[:12]}"
    staging.mkdir(parents=True)
    return staging


def _write_rank_files(staging: Path, tag: str, model: Any, optimizer: Any, user_content: Any) -> None:
    coords = state.topology.coords(state.rank)
    pp, tp = coords.pp_rank, coords.tp_rank
    if model is not None and _writes_model_parts():
        atomic_save(model.local_state_dict(), staging / model_file(pp, tp))
    if optimizer is not None:
        sharded = bool(state.cfg.shard_optimizer_state)
        if sharded or _writes_model_parts():
            rdp = coords.rdp_rank if sharded else None
            atomic_save(optimizer.local_state_dict(), staging / optimizer_file(pp, tp, rdp))
        fp16_states = getattr(optimizer, "local_fp16_state_dict", None)
        if callable(fp16_states) and _writes_model_parts():
            atomic_save(fp16_states(), staging / fp16_file(pp, tp))
    if state.rank == 0:
        atomic_save(user_content, staging / USER_CONTENT_FILE)
        atomic_save(_config_record(tag, model), staging / CONFIG_FILE)


def _config_record(tag: str, model: Any) -> dict[str, Any]:
    """What resume checks (degrees) and what a converter needs (the partition), as plain values."""
    engine = getattr(model, "pipeline_engine", None)
    partition = None
    if engine is not None:
        plan = engine.plan.to_dict()
        partition = {"assignment": plan["assignment"], "pp_size": plan["pp_size"], "method": plan["method"]}
    from smp_compat import __version__

    topo = state.topology
    return {
        "config": dict(state.cfg.to_dict()),
        "smp_version": f"smp_compat {__version__}",
        "tag": tag,
        "world_size": state.world_size,
        "pipeline_parallel_degree": topo.pp_size,
        "tensor_parallel_degree": topo.tp_size,
        "dp_size": topo.dp_size,
        "partition": partition,
    }


def publish_folder(root: Path, staging: Path, name: str, keep: int | None = None) -> None:
    """Rank 0, after every rank wrote: rename into place, update ``newest``, then drop what is not kept."""
    final = root / name
    backup = None
    if final.exists():
        backup = root / f".{name}{_BACKUP}{uuid.uuid4().hex[:12]}"
        os.replace(final, backup)
    os.replace(staging, final)
    fsync_dir(root)
    names = [n for n in read_newest(root) if n != name] + [name]
    dropped = []
    if keep is not None:
        dropped, names = names[: max(len(names) - keep, 0)], names[max(len(names) - keep, 0):]
    write_newest(root, names)
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
    for old in dropped:
        _remove_folder(root, old)


def _remove_folder(root: Path, name: str) -> None:
    """Rename first, so a kill mid-delete leaves a hidden leftover rather than a half folder under its name."""
    folder = root / name
    if not folder.is_dir():
        return
    trash = root / f".{name}{_TRASH}{uuid.uuid4().hex[:12]}"
    os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


_LEFTOVER = re.compile(r"^\.(?P<name>.+?)(?P<kind>\.tmp-|\.old-|\.trash-)[0-9a-f]+$")
_NEWEST_TEMP = re.compile(rf"^\.{NEWEST_FILE}\..+\.tmp$")  # atomic_write's temporary file of `newest`


def recover_interrupted(root: str | os.PathLike[str]) -> None:
    """Clean up after a save that was killed: drop staging and trash, put back a replaced folder if needed."""
    root = Path(root)
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if _NEWEST_TEMP.match(entry.name):  # killed while replacing `newest`: the old one is intact
            entry.unlink(missing_ok=True)
            continue
        match = _LEFTOVER.match(entry.name)
        if match is None:
            continue
        final = root / match["name"]
        if match["kind"] == _BACKUP and not final.exists():
            os.replace(entry, final)
        elif entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _save_full(root: Path, tag: str, model: Any, optimizer: Any, user_content: Any, translate: bool) -> None:
    if optimizer is not None and state.rank == 0:
        warnings.warn(
            "smp.save_checkpoint(partial=False) saves the model only (as SMP): the optimizer is not saved. "
            "Use partial=True to be able to resume training.",
            stacklevel=3,
        )
    full = None
    error = None
    try:
        if model is not None and state.topology.coords(state.rank).rdp_rank == 0:  # collective over tp too
            full = model.state_dict(gather_to_rank0=True)
            if not translate:
                full[state_dicts.PARTIAL_KEY] = False
            else:  # a swapped Hugging Face model is written in HF's own format (SMP: "if possible")
                from smp_compat.nn.huggingface import to_hf_format

                full = to_hf_format(model.module, full)
        if state.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            atomic_save(user_content, root / f"user_content_{tag}")
            if model is not None:
                atomic_save(full, root / tag)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = f"{type(exc).__name__}: {exc}"
    _raise_if_any_failed(error, f"Writing full checkpoint {tag!r} in {root}")


# ---------------------------------------------------------------------- resuming
def checkpoint_folder(path: str | os.PathLike[str], tag: str | None) -> Path:
    """The partial folder to resume: ``<tag>_partial`` (or the last line of ``newest``)."""
    root = Path(path)
    if tag is None:
        names = read_newest(root)
        if not names:
            raise CheckpointError(
                f"resume_from_checkpoint({str(path)!r}) found no `newest` file (or it is empty) there, so it cannot "
                "pick the latest partial checkpoint. Pass tag=... or the directory given to smp.save_checkpoint."
            )
        name = names[-1]
    else:
        name = tag if tag.endswith(PARTIAL_SUFFIX) and (root / tag).is_dir() else f"{_check_tag(tag)}{PARTIAL_SUFFIX}"
    folder = root / name
    if not folder.is_dir():
        folder = _backup_of(root, name) or folder
    if not folder.is_dir():
        raise CheckpointError(
            f"Partial checkpoint folder {str(root / name)!r} does not exist. Pass the path and tag given to "
            "smp.save_checkpoint (a full checkpoint needs partial=False)."
        )
    return folder


def _backup_of(root: Path, name: str) -> Path | None:
    """A save that replaced ``name`` was killed between its two renames: the old folder is still whole."""
    if not root.is_dir():
        return None
    for entry in sorted(root.iterdir()):
        match = _LEFTOVER.match(entry.name)
        if match and match["name"] == name and match["kind"] == _BACKUP and entry.is_dir():
            return entry
    return None


def check_saved_config(saved: Any, where: str) -> None:
    """Degrees that decide the parts must match this job; other differences only warn (as SMP)."""
    if not isinstance(saved, Mapping):
        return
    values = dict(saved.get("config") or {})
    values.update({k: saved[k] for k in _MUST_MATCH if k in saved})
    current = state.cfg.to_dict()
    bad = [k for k in _MUST_MATCH if k in values and values[k] != current.get(k)]
    if bad:
        changes = ", ".join(f"{k}: saved {values[k]!r}, now {current.get(k)!r}" for k in bad)
        raise CheckpointError(
            f"Checkpoint {where} cannot be resumed by this job: {changes}. A partial checkpoint's parts follow "
            "the layout it was saved with. Resume with the same degrees, or merge it into one state dict with "
            "`smp-compat checkpoint merge` and load that with model.load_state_dict()."
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
            "degrees it was saved with, or merge it with `smp-compat checkpoint merge`."
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
    ``weights_only=True`` unless ``weights_only=False`` is passed for trusted files.
    """
    state.require_init("smp.resume_from_checkpoint")
    if load_optimizer_states is not None:  # SMP 1.10's name
        load_optimizer = load_optimizer_states
    if partial:
        return _resume_partial(path, tag, strict, load_optimizer, weights_only)
    return _resume_full(path, tag, strict, translate_function, weights_only)


def _load(file: Path, weights_only: bool) -> Any:
    return safe_load(file, map_location="cpu", weights_only=weights_only)


def _resume_partial(path: Any, tag: str | None, strict: bool, load_optimizer: bool, weights_only: bool) -> Any:
    folder = checkpoint_folder(path, tag)
    config = folder / CONFIG_FILE
    if config.is_file():
        check_saved_config(_load(config, weights_only), str(folder))
    coords = state.topology.coords(state.rank)
    pp, tp = coords.pp_rank, coords.tp_rank
    model_sd = _load(folder / model_file(pp, tp), weights_only) if _check_parts(folder) else None
    optimizer_sd = None
    if load_optimizer:
        for candidate in (optimizer_file(pp, tp), optimizer_file(pp, tp, coords.rdp_rank)):
            if (folder / candidate).is_file():
                optimizer_sd = _load(folder / candidate, weights_only)
                break
    fp16_path = folder / fp16_file(pp, tp)
    fp16_sd = _load(fp16_path, weights_only) if load_optimizer and fp16_path.is_file() else None
    content = folder / USER_CONTENT_FILE
    user_content = _load(content, weights_only) if content.is_file() else None
    _apply(model_sd, {"strict": strict}, optimizer_sd, fp16_sd)
    return user_content


def _resume_full(
    path: Any, tag: str | None, strict: bool, translate: Callable[..., Any] | None, weights_only: bool
) -> Any:
    if tag is None:
        raise CheckpointError(
            "resume_from_checkpoint(partial=False) needs the tag of the full checkpoint (`newest` lists partial "
            "checkpoints only). Pass tag=... as given to smp.save_checkpoint."
        )
    root = Path(path)
    target = root / _check_tag(tag)
    if not target.is_file():
        raise CheckpointError(
            f"Full checkpoint file {str(target)!r} does not exist. Pass the path and tag given to "
            "smp.save_checkpoint(partial=False)."
        )
    model_sd = _load(target, weights_only)
    content = root / f"user_content_{tag}"
    user_content = _load(content, weights_only) if content.is_file() else None
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
    state_dicts.queue_resume(queued_model, queued_optimizer)
