"""Checkpoint converters: partial checkpoints (ours or SMP's) to one plain PyTorch state dict (``cutting.py``: back).

Reading needs neither SMP nor a running job: files load with ``weights_only=True``, and only on
request (``unsafe``) with a full unpickler that stands in placeholders for SMP's own classes.
"""

from __future__ import annotations

import os
import pickle
import re
import types
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from smp_compat.checkpoints import folders, optimizer_state, state_dicts, tp_reshard
from smp_compat.checkpoints.serialization import is_refusal, reading
from smp_compat.errors import CheckpointError

__all__ = [
    "PartFile",
    "Layout",
    "detect_layout",
    "load_file",
    "model_dict_of",
    "optimizer_dict_of",
    "merge_model",
    "merge_model_with_shards",
    "merge_optimizer",
    "SMPObject",
]

_MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim")


@dataclass(frozen=True)
class PartFile:
    """One per-rank file and the ranks its name gives."""

    path: Path
    pp_rank: int
    tp_rank: int = 0
    rdp_rank: int | None = None


@dataclass
class Layout:
    """What a source on disk is: a ``save_checkpoint`` folder or ``smp.save`` parts, and its files."""

    kind: str
    naming: str
    model_parts: list[PartFile] = field(default_factory=list)
    optimizer_parts: list[PartFile] = field(default_factory=list)
    folder: Path | None = None

    @property
    def pp_size(self) -> int:
        return len({p.pp_rank for p in self.model_parts or self.optimizer_parts})

    @property
    def tp_size(self) -> int:
        return len({p.tp_rank for p in self.model_parts or self.optimizer_parts})


# ---------------------------------------------------------------------- detection
_FOLDER_MODEL = re.compile(r"^model_(\d+)_(\d+)\.pt$")
_FOLDER_OPT = re.compile(r"^optimizer_states_(\d+)_(\d+)(?:_(\d+))?\.pt$")
_SDP_MODEL = re.compile(r"^model_(\d+)\.pt$")


def detect_layout(source: str | os.PathLike[str], tag: str | None = None) -> Layout:
    """Recognise a checkpoint folder, a checkpoint root (``newest`` or ``tag``), or an ``smp.save`` base path."""
    path = Path(source)
    if path.is_dir():
        if any(_FOLDER_MODEL.match(p.name) or _FOLDER_OPT.match(p.name) for p in path.iterdir()):
            return _folder_layout(path)
        if tag is not None or (path / folders.NEWEST_FILE).is_file():
            return _folder_layout(folders.checkpoint_folder(path, tag))
        if any(_SDP_MODEL.match(p.name) for p in path.iterdir()):
            raise CheckpointError(
                f"{path} holds sharded-data-parallel files (model_<shard>.pt): their flat parameter shards cannot "
                "be merged without SMP's sharding metadata. Save a full state dict from the SMP job instead."
            )
        raise CheckpointError(
            f"{path} is a directory without model_<pp>_<tp>.pt parts or a `newest` file. Pass a partial "
            "checkpoint folder, the directory given to save_checkpoint (with --tag if it has no `newest`), or "
            "the base path given to smp.save."
        )
    return _save_layout(path)


def _folder_layout(folder: Path) -> Layout:
    model, optimizer = [], []
    for entry in sorted(folder.iterdir()):
        if m := _FOLDER_MODEL.match(entry.name):
            model.append(PartFile(entry, int(m[1]), int(m[2])))
        elif m := _FOLDER_OPT.match(entry.name):
            optimizer.append(PartFile(entry, int(m[1]), int(m[2]), int(m[3]) if m[3] is not None else None))
    layout = Layout("checkpoint", "model_<pp>_<tp>.pt (save_checkpoint, SMP >= 1.10)", model, optimizer, folder)
    _check_complete(layout.model_parts, str(folder))
    return layout


_SAVE_NAMINGS = (
    ("v3", r"_(\d+)_(\d+)_(\d+)\.pt", "{f}_<pp>_<tp>_<rdp>.pt (smp.save v3=True)"),
    ("1.10", r"_(\d+)_(\d+)\.pt", "{f}_<pp>_<tp>.pt (smp.save, SMP >= 1.10)"),
    ("v2", r"_(\d+)_(\d+)", "{f}_<pp>_<tp> (smp.save, SMP 1.6-1.9 with tensor parallelism)"),
    ("v1", r"_(\d+)", "{f}_<mp_rank> (smp.save, SMP <= 1.9)"),
)


def _save_layout(base: Path) -> Layout:
    directory = base.parent if str(base.parent) else Path(".")
    names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    for kind, tail, naming in _SAVE_NAMINGS:
        pattern = re.compile(re.escape(base.name) + tail + "$")
        parts = []
        for name in sorted(names):
            if m := pattern.match(name):
                ranks = [int(g) for g in m.groups()]
                parts.append(PartFile(directory / name, ranks[0], *(ranks[1:2] or [0]), *(ranks[2:3] or [None])))
        if parts:
            _check_complete(parts, str(base))
            return Layout("save", naming, parts, [], None)
    if base.is_file():
        raise CheckpointError(
            f"{base} is a single file, not a set of per-rank parts: it is already a full state dict (or pass the "
            "base name given to smp.save, without the _<rank> suffix)."
        )
    raise CheckpointError(
        f"No checkpoint parts found for {str(base)!r}: expected files named {base.name}_<pp>_<tp>.pt, "
        f"{base.name}_<pp>_<tp>_<rdp>.pt, {base.name}_<pp>_<tp> or {base.name}_<rank> in {directory}."
    )


def _check_complete(parts: list[PartFile], where: str) -> None:
    """A part for every (pipeline rank, tensor-parallel rank) pair, both counted from 0."""
    if not parts:
        return
    pps = sorted({p.pp_rank for p in parts})
    if pps != list(range(len(pps))):
        raise CheckpointError(
            f"{where} has parts for pipeline ranks {pps}; ranks {sorted(set(range(max(pps) + 1)) - set(pps))} are "
            "missing. Copy every part file of the checkpoint."
        )
    tps = sorted({p.tp_rank for p in parts})
    missing = sorted({(pp, tp) for pp in pps for tp in range(max(tps) + 1)} - {(p.pp_rank, p.tp_rank) for p in parts})
    if missing:
        raise CheckpointError(f"{where} has tensor-parallel ranks {tps} but no part for (pp, tp) = {missing[:8]}. "
                              "Copy every part file of the checkpoint.")  # fmt: skip


# ---------------------------------------------------------------------- reading files
class SMPObject:
    """Stands in for an object of a class that cannot be imported here (SMP's own): keeps its data."""

    _smp_class = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, value: Any) -> None:
        self.state = value

    def __repr__(self) -> str:
        return f"<placeholder for {self._smp_class}>"


class _StubUnpickler(pickle.Unpickler):
    """Full unpickling (trusted files only) with placeholders for SMP's classes, so SMP need not be installed."""

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "smdistributed":
            return type(name, (SMPObject,), {"_smp_class": f"{module}.{name}", "__module__": __name__})
        return super().find_class(module, name)


_stub_pickle = types.ModuleType("smp_compat_stub_pickle")
_stub_pickle.Unpickler = _StubUnpickler  # type: ignore[attr-defined]
_stub_pickle.load = lambda f, **kw: _StubUnpickler(f, **kw).load()  # type: ignore[attr-defined]
_stub_pickle.__name__ = "pickle"


def load_file(path: str | os.PathLike[str], unsafe: bool = False) -> Any:
    """``torch.load`` on the CPU, weights only; ``unsafe`` unpickles anything (for files you trust)."""
    with reading(path):
        if unsafe:
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_stub_pickle)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            if not is_refusal(exc):
                raise
            raise CheckpointError(
                f"{path} holds Python objects that safe loading refuses ({str(exc).splitlines()[0]}). If you trust "
                "this file, pass --unsafe (unsafe=True); SMP's own classes then load as placeholders."
            ) from exc


def _select(obj: Any, key: str | None, defaults: tuple[str, ...], looks_right: Any, what: str, path: Path) -> Any:
    if key:
        for part in key.split("."):
            if not isinstance(obj, Mapping) or part not in obj:
                raise CheckpointError(f"{path} has no entry {key!r} (top-level keys: {_keys(obj)}).")
            obj = obj[part]
        if not looks_right(obj):
            raise CheckpointError(f"Entry {key!r} of {path} is not a {what} state dict.")
        return obj
    if looks_right(obj):
        return obj
    if isinstance(obj, Mapping):
        for candidate in defaults:
            if looks_right(obj.get(candidate)):
                return obj[candidate]
    raise CheckpointError(
        f"{path} is not a {what} state dict and has none under {list(defaults)} (top-level keys: {_keys(obj)}). "
        f"Name the entry that holds it with --key (e.g. --key model)."
    )


def _keys(obj: Any) -> Any:
    return sorted(map(str, obj))[:12] if isinstance(obj, Mapping) else type(obj).__name__


def _is_optimizer_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and "state" in obj and isinstance(obj.get("param_groups"), list)


def _is_model_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and not _is_optimizer_dict(obj)
        and any(isinstance(v, torch.Tensor) for v in obj.values())
    )


def model_dict_of(obj: Any, key: str | None, path: Path) -> Mapping[str, Any]:
    """The model state dict in a loaded part: the object itself, ``obj[key]``, or a usual entry (``model``...)."""
    return _select(obj, key, _MODEL_KEYS, _is_model_dict, "model", path)


def optimizer_dict_of(obj: Any, key: str | None, path: Path) -> Mapping[str, Any]:
    return _select(obj, key, _OPTIMIZER_KEYS, _is_optimizer_dict, "optimizer", path)


# ---------------------------------------------------------------------- merging
def _strip(sd: Mapping[str, Any], prefix: str) -> OrderedDict[str, Any]:
    """``auto``: drop ``module.`` wrappers when every tensor key has them; ``none``/``""``: keep; else that prefix."""
    out = OrderedDict(sd.items())
    if prefix in ("", "none"):
        return out
    if prefix != "auto":
        return OrderedDict((k[len(prefix):] if k.startswith(prefix) else k, v) for k, v in out.items())
    while out and all(k.startswith("module.") for k, v in out.items() if isinstance(v, torch.Tensor)):
        out = OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in out.items())
    return out


def merge_model(
    layout: Layout, key: str | None = None, strip_prefix: str = "auto", unsafe: bool = False
) -> OrderedDict:
    """One plain state dict from the model parts (pipeline ranks in order; rdp replica 0 of v3 parts)."""
    return merge_model_with_shards(layout, key, strip_prefix, unsafe)[0]


def merge_model_with_shards(
    layout: Layout, key: str | None = None, strip_prefix: str = "auto", unsafe: bool = False
) -> tuple[OrderedDict, dict[str, Any] | None]:
    """``merge_model`` (tp shards joined per pipeline rank, then the ranks), plus the saved shard record or None."""
    if not layout.model_parts:
        raise CheckpointError(f"{layout.folder or 'The source'} has no model parts (it was saved without a model).")
    dicts, table = [], None
    for group in _groups((p for p in layout.model_parts if not p.rdp_rank), lambda p: p.pp_rank):
        loaded = [model_dict_of(load_file(p.path, unsafe), key, p.path) for p in group]
        merged_pp, pp_table = tp_reshard.merge_tp_model(loaded, str(layout.folder or group[0].path.parent))
        dicts.append(merged_pp)
        table = {**(table or {}), **pp_table} if pp_table is not None else table
    merged = state_dicts.merge_model_parts(dicts)
    stripped = _strip(merged, strip_prefix)
    renamed = dict(zip(merged, stripped))  # _strip keeps the order: old name -> new name
    if table is not None:
        table = {renamed.get(k, k): v for k, v in table.items()}
    return stripped, table


def _groups(parts: Any, by: Any) -> list[list[PartFile]]:
    """Parts grouped by ``by(part)`` (groups in that order), each group in tp_rank order."""
    grid: dict[Any, list[PartFile]] = {}
    for part in parts:
        grid.setdefault(by(part), []).append(part)
    return [sorted(grid[k], key=lambda p: p.tp_rank) for k in sorted(grid)]


def merge_optimizer(layout: Layout, key: str | None = None, unsafe: bool = False) -> dict[str, Any]:
    """One plain torch optimizer dict from the optimizer parts (needs ``local_state_dict`` parts)."""
    parts = layout.optimizer_parts
    if layout.kind == "save":
        parts = layout.model_parts  # smp.save files hold whatever was saved: look for the optimizer inside
    if not parts:
        raise CheckpointError(f"{layout.folder or 'The source'} has no optimizer parts.")
    table = None
    if layout.tp_size > 1:  # the shard record is in the model parts (the first one has the whole table)
        first = layout.model_parts[0].path if layout.model_parts else None
        table = tp_reshard.shard_table(model_dict_of(load_file(first, unsafe), None, first) if first else {},
                                       layout.tp_size, str(layout.folder or parts[0].path.parent))  # fmt: skip
    dicts = [tp_reshard.merge_tp_optimizer([optimizer_dict_of(load_file(p.path, unsafe), key, p.path) for p in group],
                                           table, str(group[0].path))
             for group in _groups(parts, lambda p: (p.pp_rank, p.rdp_rank or 0))]  # fmt: skip
    return optimizer_state.merge_optimizer_parts(dicts)
