"""fp16/bf16 master weights (``fp16_states_<pp>_<tp>.pt``) carried through a tensor-parallel re-cut.

The masters are fp32 copies of the 16-bit parameters, keyed by parameter name: they are joined and cut
like the parameters (so a resumed job keeps their low bits); the loss-scaler state is the same on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from smp_compat.checkpoints.convert import load_file
from smp_compat.checkpoints.tp_reshard import Table, cut_shards, join_shards
from smp_compat.errors import CheckpointError

__all__ = ["merge_fp16_states", "split_fp16_states"]

_FP16 = re.compile(r"^fp16_states_(\d+)_(\d+)(_\d+)?\.pt$")
_MASTERS = "fp32_master_params"


def merge_fp16_states(folder: Path | None, table: Table | None, unsafe: bool = False) -> dict[str, Any] | None:
    """Every rank's masters as whole tensors by name, with rank (0, 0)'s scaler state; None without fp16 files."""
    if folder is None:
        return None
    files: dict[tuple[int, int], Path] = {}
    for path in sorted(folder.iterdir()):
        if m := _FP16.match(path.name):
            if m[3]:
                raise CheckpointError(
                    f"{folder} has per-replica fp16 states ({path.name}, saved with shard_optimizer_state): their "
                    "masters are spread over replicas and are not re-cut. Split the model and optimizer from files "
                    "(merge -o/--optimizer-output, then split --optimizer): the masters are then made from the "
                    "16-bit weights."
                )
            files[(int(m[1]), int(m[2]))] = path
    if not files:
        return None
    tp = 1 + max(t for _, t in files)
    merged: dict[str, Any] = {}
    first = None
    for pp in sorted({p for p, _ in files}):
        parts = [load_file(files[(pp, t)], unsafe) for t in range(tp)]
        first = first or parts[0]
        for name, value in parts[0][_MASTERS].items():
            spec = (table or {}).get(name) if tp > 1 else None
            merged[name] = join_shards([p[_MASTERS][name] for p in parts], spec) if spec else value
    return {**first, _MASTERS: merged}


def split_fp16_states(
    states: Mapping[str, Any], pp: int, tp: int, table: Table | None, owners: Mapping[str, int]
) -> list[list[dict[str, Any]]]:
    """Per (pp, tp) fp16 files: each pipeline rank's own masters, cut for its tp rank."""
    grid = [[{**states, _MASTERS: {}} for _ in range(tp)] for _ in range(pp)]
    for name, value in states[_MASTERS].items():
        spec = (table or {}).get(name) if tp > 1 else None
        pieces = cut_shards(value, spec, tp, name) if spec else [value] * tp
        for rank in range(tp):
            grid[owners.get(name, 0)][rank][_MASTERS][name] = pieces[rank]
    return grid
