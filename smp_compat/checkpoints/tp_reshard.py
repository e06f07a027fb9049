"""Tensor-parallel parts, offline: whole tensors from the tp shards of a partial checkpoint, and back at any degree.

Each partial model part written by smp_compat records, per shard entry, the dim it is cut along, its
blocks (a fused q|k|v weight is cut per section, so heads stay whole) and its whole shape
(``_smp_load_info["tp_shards"]``, from the modules themselves, so tp_register'ed modules work too). The
optimizer state of a shard follows it: a state tensor of the shard's shape (Adam's ``exp_avg``, SGD's
``momentum_buffer``) is joined and cut along the same dim; scalars (``step``) are the same on every tp rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from smp_compat.checkpoints.state_dicts import LOAD_INFO_KEY, PARAM_NAMES_KEY, PART_OF_KEY, PARTIAL_KEY, strip_markers
from smp_compat.errors import CheckpointError

__all__ = [
    "TP_SHARDS", "shard_table", "merge_tp_model", "split_tp_model", "merge_tp_optimizer", "split_tp_optimizer",
    "split_grid", "join_shards", "cut_shards",
]  # fmt: skip

TP_SHARDS = "tp_shards"
Table = dict[str, dict[str, Any]]


def shard_table(part: Mapping[str, Any], tp: int, where: str) -> Table | None:
    """The shard table a part was saved with; a clear error when tp > 1 parts lack it (SMP's, or older ours)."""
    info = part.get(LOAD_INFO_KEY)
    table = info.get(TP_SHARDS) if isinstance(info, Mapping) else None
    if table is None and tp > 1:
        raise CheckpointError(
            f"{where} has tensor-parallel parts (tp degree {tp}) without the record of which entries are shards and "
            "along which dim (`_smp_load_info['tp_shards']`, written by smp_compat since its tp checkpoints could be "
            "merged; SMP's own parts lack it). Save a full state dict (model.state_dict()) in the job instead, or "
            "resume the checkpoint at its own degrees and save it again with this smp_compat."
        )
    return None if table is None else {str(k): dict(v) for k, v in table.items()}


def _local_shape(spec: Mapping[str, Any], tp: int) -> list[int]:
    shape = list(spec["shape"])
    shape[spec["dim"]] //= tp
    return shape


def join_shards(values: Sequence[torch.Tensor], spec: Mapping[str, Any]) -> torch.Tensor:
    """The whole tensor from per-tp-rank shards (each rank held its part of every block)."""
    dim, blocks = spec["dim"], spec["blocks"]
    if blocks == 1:
        return torch.cat(list(values), dim=dim)
    sections = [torch.cat([v.chunk(blocks, dim=dim)[s] for v in values], dim=dim) for s in range(blocks)]
    return torch.cat(sections, dim=dim)


def cut_shards(value: torch.Tensor, spec: Mapping[str, Any], tp: int, name: str) -> list[torch.Tensor]:
    """Per-tp-rank shards of a whole tensor, as the job's modules cut it (``smp_compat.nn.module.shard``)."""
    dim, blocks = spec["dim"], spec["blocks"]
    if list(value.shape) != list(spec["shape"]):
        raise CheckpointError(
            f"Entry {name!r} has shape {list(value.shape)}, but the shard record says the whole tensor is "
            f"{list(spec['shape'])}. Use the shard record of this very model (--like a checkpoint it saved)."
        )
    if value.shape[dim] % (blocks * tp):
        raise CheckpointError(
            f"Entry {name!r} (shape {list(value.shape)}) cannot be cut into tensor_parallel_degree={tp} shards along "
            f"dim {dim}{f' in each of its {blocks} blocks' if blocks > 1 else ''}: {value.shape[dim]} is not "
            f"divisible by {blocks * tp}. Pick a tp degree that divides the model's sizes (and its heads)."
        )
    sections = value.chunk(blocks, dim=dim)
    return [torch.cat([s.chunk(tp, dim=dim)[r] for s in sections], dim=dim).clone() for r in range(tp)]


# ---------------------------------------------------------------------- model
def merge_tp_model(parts: Sequence[Mapping[str, Any]], where: str) -> tuple[OrderedDict[str, Any], Table | None]:
    """One pipeline rank's dict from its tp parts (in tp_rank order); shards joined, the rest from tp rank 0."""
    tp = len(parts)
    table = shard_table(parts[0], tp, where)
    entries = [strip_markers(p) for p in parts]
    if tp == 1:
        return entries[0], table
    keys = list(entries[0])
    for rank, e in enumerate(entries[1:], 1):
        if list(e) != keys:
            raise CheckpointError(f"{where}: the part of tp rank {rank} has other entries than tp rank 0's.")
    merged: OrderedDict[str, Any] = OrderedDict()
    for key in keys:
        value, spec = entries[0][key], (table or {}).get(key)
        if spec is None or not isinstance(value, torch.Tensor) or value.numel() == 0:
            merged[key] = value
            continue
        whole = join_shards([e[key] for e in entries], spec)
        if list(whole.shape) != list(spec["shape"]):
            raise CheckpointError(f"{where}: the shards of {key!r} join to {list(whole.shape)}, not {spec['shape']}.")
        merged[key] = whole
    return merged, table


def split_tp_model(part: Mapping[str, Any], tp: int, table: Table | None) -> list[OrderedDict[str, Any]]:
    """A pipeline rank's part cut into ``tp`` parts (shards cut, the rest copied), marked with the new degree."""
    if tp > 1 and table is None:
        raise CheckpointError(
            f"Splitting for tensor_parallel_degree={tp} needs the record of which entries are shards: pass --like "
            "with any partial checkpoint of this model saved by smp_compat (at any degrees), or split that checkpoint."
        )
    out = [OrderedDict() for _ in range(tp)]
    for key, value in strip_markers(part).items():
        spec = (table or {}).get(key)
        cut = spec is not None and isinstance(value, torch.Tensor)
        pieces = cut_shards(value, spec, tp, key) if cut else [value] * tp
        for rank in range(tp):
            out[rank][key] = pieces[rank]
    info = {**(part.get(LOAD_INFO_KEY) or {}), "tensor_parallel_degree": tp}
    if table is not None:  # no record stays no record (never an empty one that would claim "no shards")
        info[TP_SHARDS] = table
    for rank_part in out:
        rank_part[PARTIAL_KEY] = True
        rank_part[LOAD_INFO_KEY] = dict(info)
    return out


# ---------------------------------------------------------------------- optimizer
def _is_shard_state(value: Any, shape: list[int]) -> bool:
    return isinstance(value, torch.Tensor) and list(value.shape) == shape


def _check_state(name: str, key: str, value: Any, shapes: tuple[list[int], ...]) -> None:
    """A per-parameter state tensor of another shape cannot follow the shard: say so, never guess."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and list(value.shape) not in shapes:
        raise CheckpointError(
            f"Optimizer state {key!r} of the tensor-parallel parameter {name!r} has shape {list(value.shape)}, "
            f"neither the shard's nor the whole parameter's {list(shapes)}; it cannot be re-cut. Resume at the "
            "saved degrees, or split the model without --optimizer (resume_from_checkpoint(load_optimizer=False))."
        )


def _named_states(part: Mapping[str, Any], where: str) -> tuple[list[str], dict[str, Any]]:
    names = part.get(PARAM_NAMES_KEY)
    if names is None:
        raise CheckpointError(
            f"{where}: tensor-parallel optimizer parts need parameter names (`_smp_param_names`, written by "
            "smp_compat's optimizer.local_state_dict()); these have none, so their shards cannot be matched."
        )
    return list(names), {names[i]: s for i, s in part["state"].items()}


def merge_tp_optimizer(parts: Sequence[Mapping[str, Any]], table: Table | None, where: str) -> dict[str, Any]:
    """One pipeline rank's optimizer part from its tp parts: shard states joined, by parameter name."""
    tp = len(parts)
    if tp == 1:
        return dict(parts[0])
    names, first = _named_states(parts[0], where)
    others = [_named_states(p, where)[1] for p in parts[1:]]
    state: dict[int, Any] = {}
    for index, name in enumerate(names):
        if name not in first:
            continue
        spec = (table or {}).get(name)
        if spec is None:
            state[index] = first[name]
            continue
        local = _local_shape(spec, tp)
        joined = {}
        for key, value in first[name].items():
            _check_state(name, key, value, (local,))
            shards = [value] + [o[name][key] for o in others]
            joined[key] = join_shards(shards, spec) if _is_shard_state(value, local) else value
        state[index] = joined
    return {**parts[0], "state": state}


def split_tp_optimizer(part: Mapping[str, Any], tp: int, table: Table | None) -> list[dict[str, Any]]:
    """A plain (whole-tensor) optimizer part with parameter names, cut into ``tp`` parts."""
    names, states = _named_states(part, "The optimizer state")
    kept = {k: v for k, v in part.items() if k != PART_OF_KEY}  # a new part: no longer the writer's
    out = [{**kept, "state": {}} for _ in range(tp)]
    for index, name in enumerate(names):
        if name not in states:
            continue
        spec = (table or {}).get(name) if tp > 1 else None
        cut: list[dict[str, Any]] = [{} for _ in range(tp)]
        for key, value in states[name].items():
            if spec is not None:
                _check_state(name, key, value, (list(spec["shape"]),))
            whole = spec is not None and _is_shard_state(value, list(spec["shape"]))
            pieces = cut_shards(value, spec, tp, f"{name}:{key}") if whole else [value] * tp
            for rank in range(tp):
                cut[rank][key] = pieces[rank]
        for rank in range(tp):
            out[rank]["state"][index] = cut[rank]
    for rank_part in out:
        rank_part[PARTIAL_KEY] = True
        rank_part[PARAM_NAMES_KEY] = names
    return out


# ---------------------------------------------------------------------- a whole pp x tp layout
def split_grid(
    pp_parts: Sequence[Mapping[str, Any]],
    tp: int,
    table: Table | None,
    optimizer: Mapping[str, Any] | None = None,
    owners: Mapping[str, int] | None = None,
) -> tuple[list[list[OrderedDict[str, Any]]], list[list[dict[str, Any]]] | None]:
    """Model parts ``[pp][tp]`` from per-pipeline-rank parts; with a merged ``optimizer`` dict (with parameter
    names) and the pipeline rank of each entry (``owners``), optimizer parts ``[pp][tp]`` holding each rank's
    own parameters' state."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise CheckpointError(f"The tensor-parallel degree to split for must be a positive int, got {tp!r}.")
    model_grid = [split_tp_model(part, tp, table) for part in pp_parts]
    if optimizer is None:
        return model_grid, None
    names = optimizer.get(PARAM_NAMES_KEY)
    if names is None:
        raise CheckpointError(
            "The optimizer file has no parameter names (`_smp_param_names`), so its states cannot be matched to "
            "the model's entries. Pass an optimizer file written by `smp-compat checkpoint merge --optimizer-output`."
        )
    unknown = [n for n in names if owners is not None and n not in owners]
    if unknown:
        raise CheckpointError(f"The optimizer file has state for {unknown[:8]}, which the model dict does not hold.")
    optimizer_grid = []
    for pp_rank in range(len(pp_parts)):
        mine = {i: s for i, s in optimizer["state"].items() if owners is None or owners[names[i]] == pp_rank}
        optimizer_grid.append(split_tp_optimizer({**optimizer, "state": mine}, tp, table))
    return model_grid, optimizer_grid
