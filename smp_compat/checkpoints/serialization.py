"""``smp.save`` / ``smp.load``: SMP's partial (one file per rank) and full files, written atomically.

Loading is safe by default (``torch.load(weights_only=True)`` plus the harmless types of ``load_policy``);
arbitrary pickled objects load only from files the user trusts (``SMP_COMPAT_TRUST_CHECKPOINTS``, set by
``smp-compat run --trust-checkpoint``) or when the caller passes ``weights_only=False``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from smp_compat.errors import CheckpointError, SMPError
from smp_compat.globalstate import state
from smp_compat.checkpoints import signing
from smp_compat.checkpoints.atomic import atomic_save, atomic_write, fsync_dir, is_refusal
from smp_compat.checkpoints.hf_configs import config_classes
from smp_compat.checkpoints.load_policy import allow_harmless, is_trusted, refusal_message

__all__ = [
    "save", "load", "atomic_write", "atomic_save", "fsync_dir", "safe_load", "partial_path", "reading", "is_refusal",
]  # fmt: skip


def partial_path(f: str | os.PathLike[str], v3: bool = False, back_compat: bool = False) -> str:
    """This rank's part-file name: ``{f}_{pp}_{tp}.pt`` (SMP >= 1.10), ``{f}_{pp}_{tp}_{rdp}.pt`` with v3."""
    c = state.topology.coords(state.rank)
    if back_compat:
        return f"{f}_{c.pp_rank}_{c.tp_rank}" if state.topology.tp_size > 1 else f"{f}_{c.mp_rank}"
    suffix = f"_{c.rdp_rank}" if v3 else ""
    return f"{f}_{c.pp_rank}_{c.tp_rank}{suffix}.pt"


def safe_load(
    path: str | os.PathLike[str],
    map_location: Any = None,
    weights_only: bool = True,
    trust_folder: str | os.PathLike[str] | None = None,
    **kw: Any,
) -> Any:
    """``torch.load``, safe unless the caller or the user (``load_policy.TRUST_ENV``) trusts the file.

    Safe loads also accept the harmless types of ``load_policy``; a refusal explains how to trust the
    file, naming ``trust_folder`` (default: the file's folder).
    """
    if weights_only and is_trusted(path):
        weights_only = False
    with reading(path):
        if not weights_only:
            return torch.load(path, map_location=map_location, weights_only=False, **kw)
        try:
            return _load_data_only(path, map_location, **kw)
        except pickle.UnpicklingError as exc:
            if not is_refusal(exc):
                raise
            signed = _signed_bytes(path)
            if signed is not None:  # written by smp_compat under this user's key, unchanged since
                return torch.load(io.BytesIO(signed), map_location=map_location, weights_only=False, **kw)
            folder = trust_folder if trust_folder is not None else Path(path).parent
            raise CheckpointError(refusal_message(path, exc, folder)) from exc


def _load_data_only(path: Any, map_location: Any, **kw: Any) -> Any:
    """A safe load with the harmless types; refused, once more with the data-only configs the file names."""
    try:
        with allow_harmless():
            return torch.load(path, map_location=map_location, weights_only=True, **kw)
    except pickle.UnpicklingError as exc:
        if not is_refusal(exc) or not isinstance(path, (str, os.PathLike)) or not config_classes(path):
            raise
    with allow_harmless(path):
        return torch.load(path, map_location=map_location, weights_only=True, **kw)


def _signed_bytes(path: Any) -> bytes | None:
    """The file's bytes when its digest verifies (read once: what is checked is what loads), else None."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    data = Path(path).read_bytes()
    return data if signing.verifies(path, data) else None


@contextmanager
def reading(path: Any) -> Iterator[None]:
    """Around a ``torch.load`` of ``path``: a truncated or corrupt file becomes a CheckpointError naming it.

    torch's own errors (``[Errno 22]``, an empty ``EOFError``, a miniz message) do not say which file.
    """
    try:
        yield
    except SMPError:
        raise
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as exc:
        if isinstance(exc, OSError) and exc.filename is not None:
            raise  # names the file already (missing, a folder, no permission), as torch.load's callers expect
        if isinstance(exc, RuntimeError) and "PytorchStreamReader" not in str(exc):
            raise  # not the file (e.g. map_location names a device this machine lacks)
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else "no message"
        raise CheckpointError(
            f"Checkpoint file {str(path)!r} is truncated or unreadable ({type(exc).__name__}: {first}). It was cut "
            "short or damaged after it was written (a partial copy or a full disk), so nothing was loaded from it. "
            "Restore it from a complete copy, or resume an older checkpoint."
        ) from exc


def save(
    obj: Any,
    f: str | os.PathLike[str],
    partial: bool = True,
    pickle_module: Any = pickle,
    pickle_protocol: int = 2,
    v3: bool = False,
) -> None:
    """``partial=True``: every caller writes its own part file; ``partial=False``: global rank 0 writes ``f``."""
    state.require_init("smp.save")
    kwargs = {"pickle_module": pickle_module, "pickle_protocol": pickle_protocol}
    if partial:
        atomic_save(obj, partial_path(f, v3=v3), **kwargs)
    elif state.rank == 0:
        atomic_save(obj, f, **kwargs)


def load(
    f: str | os.PathLike[str],
    map_location: Any = None,
    pickle_module: Any = None,
    partial: bool = True,
    back_compat: bool = False,
    weights_only: bool = True,
    v3: bool | None = None,
    **pickle_load_args: Any,
) -> Any:
    """Load a file written by ``smp.save`` (ours or SMP's); partial loads check the part set first.

    ``v3`` (files ``{f}_{pp}_{tp}_{rdp}.pt``, saved with ``v3=True``) is detected when not given.
    """
    state.require_init("smp.load")
    if pickle_module is not None:
        pickle_load_args["pickle_module"] = pickle_module
    if not partial:
        return safe_load(f, map_location, weights_only, **pickle_load_args)
    if v3 is None:
        v3 = not back_compat and _saved_as_v3(f)
    _check_parts(f, back_compat, v3)
    path = partial_path(f, v3=v3, back_compat=back_compat)
    return safe_load(path, map_location, weights_only, **pickle_load_args)


def _saved_as_v3(f: str | os.PathLike[str]) -> bool:
    """Only this rank's v3 part exists (``{f}_{pp}_{tp}_{rdp}.pt``), not the plain one."""
    return not Path(partial_path(f)).exists() and Path(partial_path(f, v3=True)).exists()


def _check_parts(f: str | os.PathLike[str], back_compat: bool, v3: bool = False) -> None:
    """The part files on disk must be exactly one per (pp, tp) of the current layout (and rdp with v3)."""
    base = Path(f)
    topo = state.topology
    name = re.escape(base.name)
    if back_compat and topo.tp_size == 1:
        pattern = re.compile(name + r"_(\d+)$")
        expected = {(i,) for i in range(topo.pp_size)}
    elif v3:
        pattern = re.compile(name + r"_(\d+)_(\d+)_(\d+)\.pt$")
        expected = {(p, t, r) for p in range(topo.pp_size) for t in range(topo.tp_size) for r in range(topo.rdp_size)}
    else:
        pattern = re.compile(name + r"_(\d+)_(\d+)" + (r"$" if back_compat else r"\.pt$"))
        expected = {(p, t) for p in range(topo.pp_size) for t in range(topo.tp_size)}
    directory = base.parent if str(base.parent) else Path(".")
    entries = directory.iterdir() if directory.is_dir() else ()
    found = {tuple(int(g) for g in m.groups()) for p in entries if (m := pattern.match(p.name))}
    if found != expected:
        degrees = f"pipeline_parallel_degree={topo.pp_size}, tensor_parallel_degree={topo.tp_size}"
        if v3:
            degrees += f", {topo.rdp_size} reduced-data-parallel replicas (v3 names)"
        raise CheckpointError(
            f"smp.load({str(f)!r}, partial=True) found parts {sorted(found) or 'none'} but this job's "
            f"layout ({degrees}) needs {sorted(expected)}. Load with the degrees the file was saved with, "
            "or merge it with `smp-compat checkpoint merge` first."
        )
