"""Sharded (DCP) checkpoints with tensor parallelism: each tp rank's slices under their own names.

DCP keys a tensor by its name and merges equal names across ranks as one tensor (FSDP2's shards of
it over the rdp group). The tp ranks' slices of a shard parameter have the same name but different
contents, so a tp-shard entry is saved as ``<name>#tp<t>of<T>`` (model weights, and the parameter's
key in the optimizer state); tp-replicated entries keep their plain names and are written once. The
folder also gets ``tp_layout.pt`` (rank 0): ``{"tensor_parallel_degree": T, "shards": {name: {"dim",
"blocks", "shape"}}}`` (the shard record partial parts carry, nn/state.py), so ``smp-compat checkpoint
merge`` can join the slices into whole tensors offline (checkpoints/tp_reshard.py's ``join_shards``).
Resume needs the same tp degree (checked from ``smp_config.pt``); the sdp degree may change.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smp_compat.checkpoints.serialization import atomic_save, safe_load
from smp_compat.checkpoints.tp_reshard import join_shards
from smp_compat.errors import CheckpointError
from smp_compat.globalstate import state
from smp_compat.sdp.tp import tp_marks, tp_size

__all__ = ["LAYOUT", "tag_tp_slices", "untag_tp_slices", "write_layout", "join_tp_slices"]

LAYOUT = "tp_layout.pt"
_TAGGED = re.compile(r"^(?P<name>.+)#tp(?P<rank>\d+)of(?P<size>\d+)$")


def _tag(name: str) -> str:
    return f"{name}#tp{state.topology.coords(state.rank).tp_rank}of{tp_size()}"


def _rename(entries: dict[str, Any], names: set[str], forward: bool) -> dict[str, Any]:
    lookup = {_tag(n): n for n in names}
    if forward:
        return {(_tag(k) if k in names else k): v for k, v in entries.items()}
    return {lookup.get(k, k): v for k, v in entries.items()}


def _renamed(content: dict[str, Any], root: nn.Module, forward: bool) -> dict[str, Any]:
    names = set(tp_marks(root))
    out = dict(content)
    out["model"] = _rename(content["model"], names, forward)
    if "optim" in content:
        optim = dict(content["optim"])
        optim["state"] = _rename(optim["state"], names, forward)
        out["optim"] = optim
    return out


def tag_tp_slices(content: dict[str, Any], root: nn.Module) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (DCP's form) with every tp-shard entry under its tp-tagged name."""
    return _renamed(content, root, forward=True) if tp_size() > 1 else content


def untag_tp_slices(content: dict[str, Any], root: nn.Module) -> dict[str, Any]:
    """The inverse of ``tag_tp_slices`` (after ``dcp.load`` filled the tagged entries)."""
    return _renamed(content, root, forward=False) if tp_size() > 1 else content


def write_layout(folder: Path, root: nn.Module) -> None:
    """Rank 0: how each tp-shard parameter was cut (nn/state.py's shard record), for an offline merge."""
    if tp_size() > 1 and state.rank == 0:
        from smp_compat.nn.state import shard_layout

        atomic_save({"tensor_parallel_degree": tp_size(), "shards": shard_layout(root)}, Path(folder) / LAYOUT)


def _join_entries(entries: dict[str, Any], shards: dict[str, dict[str, Any]], size: int, what: str) -> dict[str, Any]:
    """Entries under plain names: tp-tagged slices joined into whole tensors (optimizer state per key)."""
    out: dict[str, Any] = {}
    slices: dict[str, dict[int, Any]] = {}
    for key, value in entries.items():
        match = _TAGGED.match(key)
        if match is None:
            out[key] = value
        else:
            slices.setdefault(match["name"], {})[int(match["rank"])] = value
    for name, by_rank in slices.items():
        if sorted(by_rank) != list(range(size)) or name not in shards:
            raise CheckpointError(
                f"{what}: tensor-parallel slices of {name!r} are incomplete ({sorted(by_rank)} of {size})."
            )
        parts = [by_rank[t] for t in range(size)]
        if isinstance(parts[0], torch.Tensor):
            out[name] = join_shards(parts, shards[name])
        else:  # an optimizer state entry: tensors shaped like the slice are joined, scalars (``step``) kept
            out[name] = {k: join_shards([p[k] for p in parts], shards[name]) if _sliced(parts[0][k]) else parts[0][k]
                         for k in parts[0]}  # fmt: skip
    return out


def _sliced(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def join_tp_slices(folder: Path, model: dict[str, Any], optim: dict[str, Any] | None) -> tuple[dict, dict | None]:
    """Offline merge: whole tensors under the plain names, for the model and the optimizer state."""
    layout_file = Path(folder) / LAYOUT
    if not layout_file.is_file():
        return model, optim
    layout = safe_load(layout_file, map_location="cpu", weights_only=True)
    size, shards = int(layout["tensor_parallel_degree"]), layout["shards"]
    model = _join_entries(model, shards, size, str(folder))
    if optim is not None:
        optim = {**optim, "state": _join_entries(optim.get("state", {}), shards, size, str(folder))}
    return model, optim
