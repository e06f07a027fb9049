"""Model and optimizer state dicts across pipeline ranks: full gathers, partial parts, deferred loads.

After partitioning each pipeline rank holds only its own modules' tensors (the others are released
to empty tensors). A *full* state dict gathers every rank's entries, under the user module's own
names and in plain PyTorch's key order; a *partial* (local) one is this rank's entries plus SMP's
markers. Loads arriving before partitioning wait for it (SMP's deferral), and a partial dict saved
under another partition is first merged over the pipeline group, so any dict loads into any layout
that has the same keys.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from smp_compat.errors import CheckpointError
from smp_compat.globalstate import process_group, state
from smp_compat.serialize import all_gather_objects, object_to_tensor, tensor_to_object

__all__ = [
    "PARTIAL_KEY",
    "LOAD_INFO_KEY",
    "PARAM_NAMES_KEY",
    "MARKER_KEYS",
    "is_partial",
    "strip_markers",
    "strip_wrapper_prefix",
    "merge_model_parts",
    "merge_optimizer_parts",
    "model_state_dict",
    "model_local_state_dict",
    "load_model_state",
    "record_param_order",
    "optimizer_state_dict",
    "optimizer_local_state_dict",
    "load_optimizer_state",
    "queue_resume",
    "saved_partition",
    "apply_pending_model_loads",
    "apply_pending_optimizer_loads",
    "attach_queued_optimizer_load",
]

PARTIAL_KEY = "_smp_is_partial"
LOAD_INFO_KEY = "_smp_load_info"
PARAM_NAMES_KEY = "_smp_param_names"
MARKER_KEYS = (PARTIAL_KEY, LOAD_INFO_KEY, PARAM_NAMES_KEY)
_WRAPPER_PREFIX = "module."
_P2P_TAG = 0x5D1C


# ---------------------------------------------------------------------- dict helpers
def is_partial(sd: Mapping[str, Any]) -> bool:
    """True for SMP's local (per-rank) dicts, marked ``_smp_is_partial: True``."""
    return bool(sd.get(PARTIAL_KEY, False))


def strip_markers(sd: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """The dict without SMP's marker keys (keeps torch's ``_metadata`` version info)."""
    out = OrderedDict((k, v) for k, v in sd.items() if k not in MARKER_KEYS)
    _copy_metadata(sd, out)
    return out


def _copy_metadata(source: Any, target: Any) -> None:
    """Carry torch's per-module version info (``state_dict()._metadata``) over to a rebuilt dict."""
    metadata = getattr(source, "_metadata", None)
    if metadata is not None:
        try:
            target._metadata = metadata
        except AttributeError:  # a plain dict cannot carry it
            pass


def strip_wrapper_prefix(sd: Mapping[str, Any], expected: Iterable[str]) -> Mapping[str, Any]:
    """Drop a ``module.`` prefix (DDP/SMP wrapper) when every key has it and the bare names are the model's."""
    expected = set(expected)
    keys = [k for k in sd if k not in MARKER_KEYS]
    if not keys or any(k in expected for k in keys):
        return sd
    stripped = OrderedDict(sd.items())
    while keys and all(k.startswith(_WRAPPER_PREFIX) for k in keys):
        stripped = OrderedDict(
            (k[len(_WRAPPER_PREFIX):] if k not in MARKER_KEYS else k, v) for k, v in stripped.items()
        )
        keys = [k for k in stripped if k not in MARKER_KEYS]
        if any(k in expected for k in keys):
            _copy_metadata(sd, stripped)
            return stripped
    return sd


def merge_model_parts(parts: Iterable[Mapping[str, Any]]) -> OrderedDict[str, Any]:
    """One dict from per-rank parts: every part's tensors, non-tensor entries from the first part that has them."""
    merged: OrderedDict[str, Any] = OrderedDict()
    for part in parts:
        for key, value in strip_markers(part).items():
            if key not in merged or _replaces(merged[key], value):
                merged[key] = value
        if not hasattr(merged, "_metadata"):
            _copy_metadata(part, merged)
    return merged


def _replaces(existing: Any, value: Any) -> bool:
    """A real tensor wins over a non-tensor or an empty placeholder (a released non-local parameter)."""
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return False
    return not isinstance(existing, torch.Tensor) or existing.numel() == 0


def _to_cpu(value: Any) -> Any:
    """Tensors (inside dicts too) on the CPU, so they can travel between ranks and into files."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        out = OrderedDict((k, _to_cpu(v)) for k, v in value.items()) if isinstance(value, OrderedDict) else {
            k: _to_cpu(v) for k, v in value.items()
        }
        _copy_metadata(value, out)
        return out
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------- pipeline-group communication
def _pp_members() -> list[int]:
    """Global ranks of this rank's pipeline group, in pp_rank order."""
    return state.topology.get_pp_group(state.rank)


def _my_pp_rank() -> int:
    return state.topology.coords(state.rank).pp_rank


def _object_device() -> torch.device:
    return state.device if state.backend == "nccl" else torch.device("cpu")


def _allgather_pp(obj: Any) -> list[Any]:
    """Every pipeline rank's ``obj``, indexed by pp_rank."""
    members = _pp_members()
    if len(members) == 1:
        return [obj]
    gathered = all_gather_objects(obj, process_group("pp"), len(members), _object_device())
    by_rank = dict(zip(sorted(members), gathered))
    return [by_rank[r] for r in members]


def _gather_pp_root(obj: Any) -> list[Any] | None:
    """Every pipeline rank's ``obj`` on pp_rank 0 (indexed by pp_rank); None elsewhere."""
    members = _pp_members()
    if len(members) == 1:
        return [obj]
    group, device = process_group("pp"), _object_device()
    if state.rank != members[0]:
        payload = object_to_tensor(obj, device)
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), members[0], group, _P2P_TAG)
        dist.send(payload, members[0], group, _P2P_TAG)
        return None
    out = [obj]
    for src in members[1:]:
        length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(length, src, group, _P2P_TAG)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        dist.recv(payload, src, group, _P2P_TAG)
        out.append(tensor_to_object(payload))
    return out


def _gather(obj: Any, to_root: bool) -> list[Any] | None:
    return _gather_pp_root(obj) if to_root else _allgather_pp(obj)


def _pipelined(model: Any) -> bool:
    """True once the model is partitioned over more than one pipeline rank (tensors spread out)."""
    return getattr(model, "pipeline_engine", None) is not None


# ---------------------------------------------------------------------- model: ownership
def _key_owners(model: Any, keys: Iterable[str]) -> dict[str, int]:
    """The pipeline rank holding each state-dict key: the rank of the module that holds the entry."""
    placement = model.pipeline_engine.placement
    modules = dict(model.module.named_modules(remove_duplicate=False))
    owners = {}
    for key in keys:
        path = key.rpartition(".")[0]
        while path not in modules:
            path = path.rpartition(".")[0]
        rank = placement.rank_of_module(modules[path])
        owners[key] = 0 if rank is None else rank
    return owners


def _load_info(model: Any) -> dict[str, Any]:
    engine = getattr(model, "pipeline_engine", None)
    partition = None
    if engine is not None:
        plan = engine.plan.to_dict()
        partition = {"assignment": plan["assignment"], "pp_size": plan["pp_size"], "method": plan["method"]}
    return {
        "tensor_parallel_degree": state.topology.tp_size,
        "pipeline_parallel_degree": state.topology.pp_size,
        "partition_info": partition,
    }


# ---------------------------------------------------------------------- model: saving
def _prefixed(entries: Mapping[str, Any], destination: Any, prefix: str) -> Any:
    out = OrderedDict() if destination is None else destination
    for key, value in entries.items():
        out[prefix + key] = value
    _copy_metadata(entries, out)
    return out


def model_state_dict(
    model: Any,
    destination: Any = None,
    prefix: str = "",
    keep_vars: bool = False,
    cast_to_cpu: bool = True,
    gather_to_rank0: bool = True,
) -> Any:
    """The full state under the user module's names, in plain PyTorch's order (tied weights under every name).

    Collective over the pipeline group once partitioned; with ``gather_to_rank0`` only pp_rank 0 gets
    the dict and the other pipeline ranks get an empty one (SMP's behaviour).
    """
    entries = model.module.state_dict(keep_vars=keep_vars)
    if state.topology.tp_size > 1:  # tensor-parallel shards become whole tensors (collective over the tp group)
        from smp_compat.nn.state import gather_shards

        entries = gather_shards(model.module, entries)
    if gather_to_rank0 and state.topology.pp_size > 1 and _my_pp_rank() != 0:
        if _pipelined(model):
            _gather(_owned_entries(model, entries), to_root=True)
        return OrderedDict() if destination is None else destination
    if not _pipelined(model):
        full = OrderedDict((k, _cast(v, cast_to_cpu, keep_vars)) for k, v in entries.items())
        _copy_metadata(entries, full)
        return _prefixed(full, destination, prefix)
    mine = _owned_entries(model, entries)
    parts = _gather(mine, to_root=gather_to_rank0)
    merged: dict[str, Any] = {}
    for part in parts or ():
        merged.update(part)
    local = set(mine)
    full = OrderedDict()
    for key, value in entries.items():
        if key in local:
            full[key] = _cast(value, cast_to_cpu, keep_vars)
        elif key in merged:
            full[key] = merged[key] if cast_to_cpu else _to_device(merged[key], state.device)
    _copy_metadata(entries, full)
    return _prefixed(full, destination, prefix)


def _cast(value: Any, cast_to_cpu: bool, keep_vars: bool) -> Any:
    """This rank's own entry: on the CPU when asked; a CPU Parameter stays itself with ``keep_vars``."""
    if not cast_to_cpu or (keep_vars and isinstance(value, torch.Tensor) and value.device.type == "cpu"):
        return value
    return _to_cpu(value)


def _owned_entries(model: Any, entries: Mapping[str, Any]) -> OrderedDict:
    """The entries this pipeline rank holds, on the CPU (for sending to the gathering rank)."""
    owners = _key_owners(model, entries)
    me = _my_pp_rank()
    return OrderedDict((k, _to_cpu(v)) for k, v in entries.items() if owners[k] == me)


def model_local_state_dict(model: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
    """This rank's entries plus every non-tensor entry, marked partial with the layout it was saved under."""
    entries = model.module.state_dict(keep_vars=keep_vars)
    if _pipelined(model):
        owners = _key_owners(model, entries)
        me = _my_pp_rank()
        local = OrderedDict(
            (k, v) for k, v in entries.items() if owners[k] == me or not isinstance(v, torch.Tensor)
        )
    else:
        local = OrderedDict(entries)
    _copy_metadata(entries, local)
    out = _prefixed(local, destination, prefix)
    out[PARTIAL_KEY] = True
    out[LOAD_INFO_KEY] = _load_info(model)
    return out


# ---------------------------------------------------------------------- model: loading
@dataclass
class _PendingModelLoad:
    """A load that waits for partitioning."""

    state_dict: Mapping[str, Any]
    strict: bool
    same_partition_load: bool


def load_model_state(
    model: Any,
    state_dict: Mapping[str, Any],
    strict: bool = True,
    translate_function: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
    same_partition_load: bool = True,
) -> _IncompatibleKeys:
    """Load a full, partial or plain PyTorch dict; before partitioning, check the names and wait."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"model.load_state_dict() expects a dict (a state dict), got {type(state_dict).__name__}. Pass "
            "what model.state_dict(), model.local_state_dict() or torch's module.state_dict() returned."
        )
    if is_partial(state_dict):
        if not model.partitioned:
            model._pending_state_dict = _PendingModelLoad(state_dict, strict, same_partition_load)
            return _IncompatibleKeys([], [])
        return _load_partial_now(model, state_dict, strict, same_partition_load)
    full = _prepare_full(model, state_dict, translate_function)
    if not model.partitioned:
        result = _check_names(model, full, strict)
        model._pending_state_dict = _PendingModelLoad(full, strict, same_partition_load)
        return result
    return _load_now(model, full, strict, fill_non_local=False)


def _prepare_full(model: Any, sd: Mapping[str, Any], translate: Callable[..., Any] | None) -> Mapping[str, Any]:
    if translate is None and PARTIAL_KEY not in sd:  # a swapped HF model takes HF checkpoints as they are
        from smp_compat.nn.huggingface import from_hf_translator

        translate = from_hf_translator(model.module, sd)
    if translate is not None and PARTIAL_KEY not in sd:
        sd = translate(sd)
    sd = strip_markers(sd)
    return strip_wrapper_prefix(sd, model.module.state_dict(keep_vars=True).keys())


def _check_names(model: Any, sd: Mapping[str, Any], strict: bool) -> _IncompatibleKeys:
    """Missing/unexpected names now, so a wrong dict fails at the call, not at the first step."""
    expected = list(model.module.state_dict(keep_vars=True).keys())
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in set(expected)]
    if strict and (missing or unexpected):
        raise CheckpointError(_mismatch_message(type(model.module).__name__, missing, unexpected))
    return _IncompatibleKeys(missing, unexpected)


def _mismatch_message(model_name: str, missing: list[str], unexpected: list[str]) -> str:
    def listing(names: list[str]) -> str:
        shown = ", ".join(repr(n) for n in names[:8])
        return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    parts = []
    if missing:
        parts.append(f"missing keys {listing(missing)}")
    if unexpected:
        parts.append(f"unexpected keys {listing(unexpected)}")
    return (
        f"The state dict does not match {model_name}: {'; '.join(parts)}. Load a dict saved from this model, "
        "pass translate_function=... to rename keys, or strict=False to load the matching keys only."
    )


def _load_now(model: Any, entries: Mapping[str, Any], strict: bool, fill_non_local: bool) -> _IncompatibleKeys:
    """Copy this rank's entries with torch's own loader; other ranks' tensors are stand-ins of themselves.

    A non-local tensor is an empty placeholder here, so its entry is replaced by that placeholder
    (copied onto itself); ``fill_non_local`` also supplies the non-local keys a partial part lacks.
    """
    prepared: OrderedDict[str, Any] = OrderedDict(entries)
    if _pipelined(model):
        current = model.module.state_dict(keep_vars=True)
        owners = _key_owners(model, current)
        me = _my_pp_rank()
        for key, value in current.items():
            if owners[key] == me or not isinstance(value, torch.Tensor):
                continue
            if key in prepared or fill_non_local:
                prepared[key] = value
    if state.topology.tp_size > 1:  # whole tensors of a full dict are cut to this rank's shards
        from smp_compat.nn.state import slice_for_rank

        prepared = slice_for_rank(model.module, prepared)
    _copy_metadata(entries, prepared)
    try:
        return model.module.load_state_dict(prepared, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{exc}\nLoad a dict saved from this model, pass translate_function=... to rename keys, or "
            "strict=False to load the matching keys only."
        ) from exc


def _same_partition(model: Any, info: Any) -> bool:
    """The part was saved by this very layout: same degrees and the same module-to-rank assignment."""
    if not isinstance(info, Mapping):
        return False
    topo = state.topology
    if info.get("pipeline_parallel_degree") != topo.pp_size or info.get("tensor_parallel_degree", 1) != topo.tp_size:
        return False
    if not _pipelined(model):
        return True
    saved = info.get("partition_info")
    saved_assignment = saved.get("assignment") if isinstance(saved, Mapping) else None
    return saved_assignment == model.pipeline_engine.plan.assignment


def _load_partial_now(
    model: Any, part: Mapping[str, Any], strict: bool, same_partition_load: bool
) -> _IncompatibleKeys:
    """Same partition: each rank loads its own part. Otherwise merge every rank's part, then load."""
    info = part.get(LOAD_INFO_KEY)
    saved_pp = info.get("pipeline_parallel_degree") if isinstance(info, Mapping) else None
    if saved_pp == 1 and state.topology.pp_size > 1:  # the only part of a pp = 1 save is the whole model
        entries = strip_wrapper_prefix(strip_markers(part), model.module.state_dict(keep_vars=True).keys())
        return _load_now(model, entries, strict, fill_non_local=False)
    if isinstance(saved_pp, int) and saved_pp != state.topology.pp_size:
        raise CheckpointError(
            f"This partial state dict is one of {saved_pp} parts saved with pipeline_parallel_degree={saved_pp}, "
            f"but this job has pipeline_parallel_degree={state.topology.pp_size}, so its ranks cannot hold every part. "
            "Merge the parts into one full dict (`smp-compat checkpoint merge`) and load that."
        )
    direct = same_partition_load and _same_partition(model, info)
    if all(_allgather_pp(direct)):
        entries = strip_wrapper_prefix(strip_markers(part), model.module.state_dict(keep_vars=True).keys())
        return _load_now(model, entries, strict, fill_non_local=True)
    parts = _allgather_pp(_to_cpu(strip_markers(part)))
    merged = strip_wrapper_prefix(merge_model_parts(parts), model.module.state_dict(keep_vars=True).keys())
    return _load_now(model, merged, strict, fill_non_local=False)


def _apply_model_load(model: Any, pending: _PendingModelLoad) -> None:
    if is_partial(pending.state_dict):
        _load_partial_now(model, pending.state_dict, pending.strict, pending.same_partition_load)
    else:
        _load_now(model, pending.state_dict, pending.strict, fill_non_local=False)


# ---------------------------------------------------------------------- optimizer
# Parameters are identified by NAME (the user module's parameter name), never by torch's index
# alone: a pipeline rank's optimizer has state only for its local parameters, and fp16 masters or
# optimizer-state sharding change each rank's param_groups after partitioning. ``record_param_order``
# keeps the groups as the user built them, which is the index order of the full (plain) dict.
_GROUP_LIST_KEYS = ("params", "param_names")


def record_param_order(optimizer: torch.optim.Optimizer) -> None:
    """At ``DistributedOptimizer``: the parameter names of each group, as the user created them."""
    canonical = {id(p): n for n, p in state.model.module.named_parameters()}
    optimizer._smp_full_groups = [  # type: ignore[attr-defined]
        [canonical[id(p)] for p in group["params"]] for group in optimizer.param_groups
    ]


def _full_groups(optimizer: torch.optim.Optimizer) -> list[list[str]]:
    groups = getattr(optimizer, "_smp_full_groups", None)
    if groups is None:
        record_param_order(optimizer)
        groups = optimizer._smp_full_groups  # type: ignore[attr-defined]
    return groups


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Parameters in torch's state-dict index order."""
    return list(chain.from_iterable(group["params"] for group in optimizer.param_groups))


def _aliases(optimizer: torch.optim.Optimizer) -> dict[int, nn.Parameter]:
    """fp32 master parameter -> the model parameter it stands for (fp16 wrapper around this optimizer)."""
    wrapper = state.optimizer
    if wrapper is None or getattr(wrapper, "optimizer", None) is not optimizer:
        return {}
    pairs = wrapper.master_params() if hasattr(wrapper, "master_params") else []
    return {id(master): p for p, master in pairs}


def _current_params(optimizer: torch.optim.Optimizer) -> tuple[list[str], set[int]]:
    """Name of each parameter in torch's index order now, and the indices this pipeline rank holds."""
    model = state.model
    canonical = {id(p): n for n, p in model.module.named_parameters()}
    aliases = _aliases(optimizer)
    local = {id(p) for _, p in model.local_named_parameters()} if _pipelined(model) else None
    names, mine = [], set()
    for i, p in enumerate(_optimizer_params(optimizer)):
        source = aliases.get(id(p), p)
        names.append(canonical.get(id(source), f"<unnamed parameter {i}>"))
        if local is None or id(source) in local:
            mine.add(i)
    return names, mine


def optimizer_local_state_dict(optimizer: torch.optim.Optimizer, original_state_dict: Callable[[], dict]) -> dict:
    """Torch's dict with the state of this rank's parameters only, marked partial, with parameter names.

    The names (one per torch index) let the state find its parameters again after a restart or
    under another partition, and let the parts be merged into one plain dict.
    """
    sd = dict(original_state_dict())
    names, mine = _current_params(optimizer)
    sd["state"] = {i: s for i, s in sd["state"].items() if i in mine}
    sd[PARTIAL_KEY] = True
    sd[PARAM_NAMES_KEY] = names
    return sd


def _by_name(sd: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """Saved states keyed by parameter name."""
    out = {}
    for index, value in sd["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(names):
            raise CheckpointError(
                f"The optimizer state dict has state for index {index!r}, but it describes {len(names)} "
                "parameters. Load a dict saved from an optimizer over the same parameters."
            )
        out[names[index]] = value
    return out


def _plain_dict(optimizer: torch.optim.Optimizer, states: Mapping[str, Any]) -> dict:
    """Plain torch format over the parameters as the user grouped them; hyperparameters from this rank."""
    full = _full_groups(optimizer)
    flat = list(chain.from_iterable(full))
    groups, start = [], 0
    for names, group in zip(full, optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k not in _GROUP_LIST_KEYS}
        groups.append({**hyper, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": {i: states[n] for i, n in enumerate(flat) if n in states}, "param_groups": groups}


def optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    original_state_dict: Callable[[], dict],
    gather_to_rank0: bool = False,
    cast_to_cpu: bool = True,
) -> dict:
    """Plain torch format over every parameter: the local states of all pipeline ranks, merged.

    Without pipeline partitioning or changed param groups it is torch's own ``state_dict()``.
    """
    model = state.model
    names, _ = _current_params(optimizer)
    if not _pipelined(model) and names == list(chain.from_iterable(_full_groups(optimizer))):
        return original_state_dict()
    local = optimizer_local_state_dict(optimizer, original_state_dict)
    named = {names[i]: _to_cpu(s) for i, s in local["state"].items()}
    parts = _gather(named, to_root=gather_to_rank0)
    if parts is None:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    if not cast_to_cpu:
        merged = {n: _to_device(s, state.device) for n, s in merged.items()}
    return _plain_dict(optimizer, merged)


def merge_optimizer_parts(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One plain torch optimizer dict from per-rank parts (the converter; no optimizer object at hand).

    With parameter names, index i of the result is the i-th name in the first part's order, and the
    groups and hyperparameters come from the first part; without names, torch indices are kept.
    """
    parts = list(parts)
    if not parts:
        raise CheckpointError("No optimizer parts to merge; pass at least one optimizer state dict.")
    for part in parts:
        _check_optimizer_dict(part)
    order = parts[0].get(PARAM_NAMES_KEY)
    if order is None:
        states: dict[int, Any] = {}
        for part in parts:
            states.update(part["state"])
        return {"state": {i: states[i] for i in sorted(states)}, "param_groups": parts[0]["param_groups"]}
    named: dict[str, Any] = {}
    for part in parts:
        named.update(_by_name(part, part.get(PARAM_NAMES_KEY) or order))
    extra = [n for n in named if n not in order]
    order = list(order) + extra
    groups = [dict(g) for g in parts[0]["param_groups"]]
    if extra:
        groups[-1]["params"] = list(groups[-1]["params"]) + list(range(len(order) - len(extra), len(order)))
    for g in groups:
        g.pop("param_names", None)
    return {"state": {i: named[n] for i, n in enumerate(order) if n in named}, "param_groups": groups}


def _check_optimizer_dict(sd: Any) -> None:
    if not isinstance(sd, Mapping) or "state" not in sd or not isinstance(sd.get("param_groups"), list):
        keys = sorted(map(str, sd))[:10] if isinstance(sd, Mapping) else type(sd).__name__
        raise CheckpointError(
            "An optimizer state dict needs 'state' and 'param_groups' (what optimizer.state_dict() returns); "
            f"got {keys}. Pass an optimizer state dict."
        )


def _check_groups(optimizer: torch.optim.Optimizer, sd: Mapping[str, Any]) -> None:
    """Same number of groups; a dict without names must also match the groups' sizes (index order)."""
    _check_optimizer_dict(sd)
    full = _full_groups(optimizer)
    saved = sd["param_groups"]
    if len(saved) != len(full):
        raise CheckpointError(
            f"The optimizer state dict has {len(saved)} parameter group(s), this optimizer {len(full)}. Create the "
            "optimizer with the same parameter groups as the one that was saved."
        )
    if PARAM_NAMES_KEY not in sd:
        theirs = [len(g.get("params", ())) for g in saved]
        mine = [len(g) for g in full]
        if theirs != mine:
            raise CheckpointError(
                f"The optimizer state dict has parameter groups of sizes {theirs}, this optimizer {mine}. Create "
                "the optimizer over the same parameters, in the same order, as the one that was saved."
            )


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, sd: Mapping[str, Any], original_load: Callable[[dict], None]
) -> None:
    """Load a full or partial dict (by parameter name); before the model is partitioned, wait for it."""
    _check_groups(optimizer, sd)
    model = state.model
    if model is None or not model.partitioned:
        optimizer._smp_pending_load = sd  # type: ignore[attr-defined]
        _PENDING_OPTIMIZERS.append((state.launch, weakref.ref(optimizer)))
        return
    names, mine = _current_params(optimizer)
    full_names = list(chain.from_iterable(_full_groups(optimizer)))
    saved_names = sd.get(PARAM_NAMES_KEY) or (full_names if not is_partial(sd) else names)
    states = _by_name(sd, saved_names)
    if is_partial(sd):
        local_names = {names[i] for i in mine}
        if not all(_allgather_pp(all(n in local_names for n in states))):
            states = {}
            for part in _allgather_pp(_to_cpu(_by_name(sd, saved_names))):
                states.update(part)
    unknown = sorted(n for n in states if n not in set(full_names))
    if unknown:
        raise CheckpointError(
            f"The optimizer state dict has state for parameters {unknown[:8]} that this optimizer does not hold. "
            "Load a dict saved from this model's optimizer."
        )
    groups, start = [], 0
    for saved, group in zip(sd["param_groups"], optimizer.param_groups):
        hyper = {k: v for k, v in saved.items() if k not in _GROUP_LIST_KEYS}
        groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    kept = {i: states[n] for i, n in enumerate(names) if i in mine and n in states}
    original_load({"state": kept, "param_groups": groups})


# ---------------------------------------------------------------------- deferred loads and resume
_PENDING_OPTIMIZERS: list[tuple[Any, weakref.ref]] = []
_QUEUED: dict[str, Any] = {}


def queue_resume(model_load: dict[str, Any] | None, optimizer_sd: Mapping[str, Any] | None) -> None:
    """Remember a resume made before the model/optimizer exist; applied when they are created/partitioned.

    ``model_load`` holds the keyword arguments of ``model.load_state_dict``.
    """
    _QUEUED.clear()
    _QUEUED.update(launch=state.launch, model=model_load, optimizer=optimizer_sd)


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
    if isinstance(pending, _PendingModelLoad) and pending.same_partition_load:
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


def apply_pending_model_loads(model: Any) -> None:
    """After partitioning, before fp16 masters are copied from the weights: a queued resume, a deferred load."""
    queued = _take_queued("model")
    if queued is not None:
        model.load_state_dict(**queued)
    pending, model._pending_state_dict = model._pending_state_dict, None
    if pending is not None:
        _apply_model_load(model, pending)


def apply_pending_optimizer_loads() -> None:
    """After the optimizer's own partition-time setup (fp16 masters, sharding): deferred optimizer loads."""
    entries = [(launch, ref) for launch, ref in _PENDING_OPTIMIZERS if launch is state.launch]
    _PENDING_OPTIMIZERS.clear()
    for _, ref in entries:
        optimizer = ref()
        sd = getattr(optimizer, "_smp_pending_load", None)
        if optimizer is not None and sd is not None:
            optimizer._smp_pending_load = None  # type: ignore[attr-defined]
            optimizer.load_state_dict(sd)
