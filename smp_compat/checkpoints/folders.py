"""``smp.save_checkpoint``: SMP's checkpoint folders (partial and full), written atomically.

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
from pathlib import Path
from typing import Any

from smp_compat.checkpoints import state_dicts
from smp_compat.checkpoints.state_dicts import PART_OF_KEY
from smp_compat.errors import CheckpointError
from smp_compat.globalstate import process_group, state
from smp_compat.checkpoints.serialization import atomic_save, atomic_write, fsync_dir
from smp_compat.comm import all_gather_objects, broadcast_object, object_device

__all__ = [
    "save_checkpoint",
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
    "check_tag",
    "recover_interrupted",
    "publish_folder",
    "staging_folder",
    "raise_if_any_failed",
    "SAVED_OPTIMIZER_KEY",
    "SAVED_FP16_KEY",
]

NEWEST_FILE = "newest"
PARTIAL_SUFFIX = "_partial"
CONFIG_FILE = "smp_config.pt"
USER_CONTENT_FILE = "user_content.pt"
_STAGING = ".tmp-"
_BACKUP = ".old-"
_TRASH = ".trash-"
SAVED_OPTIMIZER_KEY = "saved_optimizer"  # in the config record: resume then needs every rank's optimizer part
SAVED_FP16_KEY = "saved_fp16"  # likewise for the fp16 masters


# ---------------------------------------------------------------------- names
def model_file(pp_rank: int, tp_rank: int) -> str:
    return f"model_{pp_rank}_{tp_rank}.pt"


def optimizer_file(pp_rank: int, tp_rank: int, rdp_rank: int | None = None) -> str:
    """``optimizer_states_<pp>_<tp>.pt``; with optimizer-state sharding every rdp rank has ``..._<rdp>.pt``."""
    suffix = f"_{rdp_rank}" if rdp_rank is not None else ""
    return f"optimizer_states_{pp_rank}_{tp_rank}{suffix}.pt"


def fp16_file(pp_rank: int, tp_rank: int, rdp_rank: int | None = None) -> str:
    """``fp16_states_<pp>_<tp>.pt``; with optimizer-state sharding each rdp rank holds the fp32 masters of its
    own share only, so every rdp rank writes ``..._<rdp>.pt``."""
    suffix = f"_{rdp_rank}" if rdp_rank is not None else ""
    return f"fp16_states_{pp_rank}_{tp_rank}{suffix}.pt"


def check_tag(tag: Any) -> str:
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
    return all_gather_objects(obj, process_group("world"), state.world_size, object_device())


def _from_rank0(obj: Any) -> Any:
    if state.world_size == 1:
        return obj
    return broadcast_object(obj, 0, process_group("world"), object_device())


def _agree_on_tag(tag: str) -> None:
    tags = _all_gather(tag)
    if len(set(tags)) > 1:
        by_rank = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise CheckpointError(
            f"smp.save_checkpoint was called with different tags on different ranks ({by_rank}). Every rank "
            "must pass the same tag, e.g. derived from the step counter rather than from time or rank."
        )


def raise_if_any_failed(
    error: str | None, what: str, advice: str = "The previous checkpoint and `newest` are unchanged."
) -> None:
    """Collective over the world: every rank raises the same error when any rank had one (none enters a
    later collective alone and hangs). Ranks with the same error are listed together."""
    failed: dict[str, list[int]] = {}
    for rank, message in enumerate(_all_gather(error)):
        if message:
            failed.setdefault(message.rstrip("."), []).append(rank)
    if failed:
        shown = list(failed.items())[:_SHOWN_ERRORS]
        listing = "; ".join(f"{_ranks(ranks)}: {message}" for message, ranks in shown)
        if len(failed) > len(shown):
            listing += f"; and {len(failed) - len(shown)} more different error(s)"
        raise CheckpointError(f"{what} failed. {listing}. {advice}")


_SHOWN_ERRORS = 4  # distinct errors listed; the rest are counted (a large job's ranks fail alike)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


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
    tag = check_tag(tag)
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
        raise_if_any_failed(error, f"Writing checkpoint {name!r} in {root}")
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
    raise_if_any_failed(error, f"Publishing checkpoint {name!r} in {root}")


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
    if state.cfg.sharded_data_parallel_degree > 1:  # every rank writes its shards (DCP), whatever its replica
        from smp_compat.sdp.checkpoint import write_sharded

        write_sharded(staging, model, optimizer)
    else:
        _write_part_files(staging, model, optimizer)
    if state.rank == 0:
        atomic_save(user_content, staging / USER_CONTENT_FILE)
        atomic_save(_config_record(tag, model, optimizer), staging / CONFIG_FILE)


def _write_part_files(staging: Path, model: Any, optimizer: Any) -> None:
    coords = state.topology.coords(state.rank)
    pp, tp = coords.pp_rank, coords.tp_rank
    if model is not None and _writes_model_parts():
        atomic_save(model.local_state_dict(), staging / model_file(pp, tp))
    if optimizer is not None:
        sharded = bool(state.cfg.shard_optimizer_state)
        if sharded or _writes_model_parts():
            rdp = coords.rdp_rank if sharded else None
            part = {**optimizer.local_state_dict(), PART_OF_KEY: {"pp_rank": pp, "tp_rank": tp, "rdp_rank": rdp}}
            atomic_save(part, staging / optimizer_file(pp, tp, rdp))
        fp16_states = getattr(optimizer, "local_fp16_state_dict", None)
        if callable(fp16_states) and (sharded or _writes_model_parts()):
            atomic_save(fp16_states(), staging / fp16_file(pp, tp, rdp))


def _config_record(tag: str, model: Any, optimizer: Any = None) -> dict[str, Any]:
    """What resume checks (degrees, which part files must exist) and what a converter needs (the partition)."""
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
        "sharded_data_parallel_degree": state.cfg.sharded_data_parallel_degree,
        "partition": partition,
        SAVED_OPTIMIZER_KEY: optimizer is not None,
        SAVED_FP16_KEY: callable(getattr(optimizer, "local_fp16_state_dict", None)),
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
        # rdp_rank 0, not dp_rank 0: the gather is collective over the tensor-parallel group too
        writes = state.cfg.sharded_data_parallel_degree > 1 or state.topology.coords(state.rank).rdp_rank == 0
        if model is not None and writes:
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
    raise_if_any_failed(error, f"Writing full checkpoint {tag!r} in {root}")


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
        name = tag if tag.endswith(PARTIAL_SUFFIX) and (root / tag).is_dir() else f"{check_tag(tag)}{PARTIAL_SUFFIX}"
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
