"""Model state dicts across pipeline ranks: full gathers, partial parts, loads (and the helpers optimizers share).

After partitioning each pipeline rank holds only its own modules' tensors (the others are released
to empty tensors). A *full* state dict gathers every rank's entries, under the user module's own
names and in plain PyTorch's key order; a *partial* (local) one is this rank's entries plus SMP's
markers. Loads arriving before partitioning wait for it (SMP's deferral), and a partial dict saved
under another partition is first merged over the pipeline group, so any dict loads into any layout
that has the same keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from smp_compat.errors import CheckpointError
from smp_compat.checkpoints.pp_gather import allgather_pp, gather, my_pp_rank
from smp_compat.globalstate import state

__all__ = [
    "PARTIAL_KEY",
    "LOAD_INFO_KEY",
    "PARAM_NAMES_KEY",
    "PART_OF_KEY",
    "MARKER_KEYS",
    "PendingModelLoad",
    "apply_model_load",
    "is_partial",
    "strip_markers",
    "strip_wrapper_prefix",
    "translate_full",
    "merge_model_parts",
    "model_state_dict",
    "model_local_state_dict",
    "load_model_state",
    "pipelined",
    "to_cpu",
    "to_device",
]

PARTIAL_KEY = "_smp_is_partial"
LOAD_INFO_KEY = "_smp_load_info"
PARAM_NAMES_KEY = "_smp_param_names"
PART_OF_KEY = "_smp_part_of"  # a checkpoint's optimizer part: the pp/tp/rdp ranks that wrote it (checked at resume)
MARKER_KEYS = (PARTIAL_KEY, LOAD_INFO_KEY, PARAM_NAMES_KEY, PART_OF_KEY)
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP/SMP wrappers; torch.compile's OptimizedModule


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
    """Drop ``module.`` (DDP/SMP wrapper) or ``_orig_mod.`` (torch.compile) prefixes when every key has one and
    the bare names are the model's."""
    expected = set(expected)
    keys = [k for k in sd if k not in MARKER_KEYS]
    if not keys or any(k in expected for k in keys):
        return sd
    stripped = OrderedDict(sd.items())
    while keys and (prefix := _shared_prefix(keys)):
        stripped = OrderedDict((k[len(prefix):] if k not in MARKER_KEYS else k, v) for k, v in stripped.items())
        keys = [k for k in stripped if k not in MARKER_KEYS]
        if any(k in expected for k in keys):
            _copy_metadata(sd, stripped)
            return stripped
    return sd


def _shared_prefix(keys: list[str]) -> str | None:
    return next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in keys)), None)


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


def to_cpu(value: Any) -> Any:
    """Tensors (inside dicts too) on the CPU, so they can travel between ranks and into files."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        out = OrderedDict((k, to_cpu(v)) for k, v in value.items()) if isinstance(value, OrderedDict) else {
            k: to_cpu(v) for k, v in value.items()
        }
        _copy_metadata(value, out)
        return out
    return value


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def pipelined(model: Any) -> bool:
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


def _load_info(model: Any, prefix: str = "") -> dict[str, Any]:
    """The layout a partial part was saved under; ``tp_shards`` lets ``smp-compat checkpoint`` re-cut its shards."""
    from smp_compat.nn.state import shard_layout

    engine = getattr(model, "pipeline_engine", None)
    partition = None
    if engine is not None:
        plan = engine.plan.to_dict()
        partition = {"assignment": plan["assignment"], "pp_size": plan["pp_size"], "method": plan["method"]}
    return {
        "tensor_parallel_degree": state.topology.tp_size,
        "pipeline_parallel_degree": state.topology.pp_size,
        "partition_info": partition,
        "tp_shards": {prefix + name: spec for name, spec in shard_layout(model.module).items()},
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
    if gather_to_rank0 and state.topology.pp_size > 1 and my_pp_rank() != 0:
        if pipelined(model):
            gather(_owned_entries(model, entries), to_root=True)
        return OrderedDict() if destination is None else destination
    if not pipelined(model):
        full = OrderedDict((k, _cast(v, cast_to_cpu, keep_vars)) for k, v in entries.items())
        _share_tied(model.module, full)
        _copy_metadata(entries, full)
        return _prefixed(full, destination, prefix)
    mine = _owned_entries(model, entries)
    parts = gather(mine, to_root=gather_to_rank0)
    merged: dict[str, Any] = {}
    for part in parts or ():
        merged.update(part)
    local = set(mine)
    full = OrderedDict()
    for key, value in entries.items():
        if key in local:
            full[key] = _cast(value, cast_to_cpu, keep_vars)
        elif key in merged:
            full[key] = merged[key] if cast_to_cpu else to_device(merged[key], state.device)
    _share_tied(model.module, full)
    _copy_metadata(entries, full)
    return _prefixed(full, destination, prefix)


def _share_tied(module: nn.Module, full: MutableMapping[str, Any]) -> None:
    """Tied weights under one tensor again, as in ``module.state_dict()``: gathering pickled each name apart."""
    first: dict[int, str] = {}
    tensors = chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        if tensor is None:
            continue
        owner = first.setdefault(id(tensor), name)
        if owner != name and owner in full and name in full:
            full[name] = full[owner]


def _cast(value: Any, cast_to_cpu: bool, keep_vars: bool) -> Any:
    """This rank's own entry: on the CPU when asked; a CPU Parameter stays itself with ``keep_vars``."""
    if not cast_to_cpu or (keep_vars and isinstance(value, torch.Tensor) and value.device.type == "cpu"):
        return value
    return to_cpu(value)


def _owned_entries(model: Any, entries: Mapping[str, Any]) -> OrderedDict:
    """The entries this pipeline rank holds, on the CPU (for sending to the gathering rank)."""
    owners = _key_owners(model, entries)
    me = my_pp_rank()
    return OrderedDict((k, to_cpu(v)) for k, v in entries.items() if owners[k] == me)


def model_local_state_dict(model: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
    """This rank's entries plus every non-tensor entry, marked partial with the layout it was saved under."""
    entries = model.module.state_dict(keep_vars=keep_vars)
    if pipelined(model):
        owners = _key_owners(model, entries)
        me = my_pp_rank()
        local = OrderedDict(
            (k, v) for k, v in entries.items() if owners[k] == me or not isinstance(v, torch.Tensor)
        )
    else:
        local = OrderedDict(entries)
    _copy_metadata(entries, local)
    out = _prefixed(local, destination, prefix)
    out[PARTIAL_KEY] = True
    out[LOAD_INFO_KEY] = _load_info(model, prefix)
    return out


# ---------------------------------------------------------------------- model: loading
@dataclass
class PendingModelLoad:
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
            model._pending_state_dict = PendingModelLoad(state_dict, strict, same_partition_load)
            return _IncompatibleKeys([], [])
        return _load_partial_now(model, state_dict, strict, same_partition_load)
    full = _prepare_full(model, state_dict, translate_function)
    if not model.partitioned:
        result = _check_names(model, full, strict)
        model._pending_state_dict = PendingModelLoad(full, strict, same_partition_load)
        return result
    return _load_now(model, full, strict, fill_non_local=False)


def _prepare_full(model: Any, sd: Mapping[str, Any], translate: Callable[..., Any] | None) -> Mapping[str, Any]:
    if PARTIAL_KEY not in sd:
        sd = translate_full(model.module, sd, translate)
    sd = strip_markers(sd)
    return strip_wrapper_prefix(sd, model.module.state_dict(keep_vars=True).keys())


def translate_full(
    module: nn.Module, sd: Mapping[str, Any], translate: Callable[..., Any] | None
) -> Mapping[str, Any]:
    """A full dict through ``translate``; without one, through the translation a swapped Hugging Face model needs
    when ``sd`` has Hugging Face's names (SMP: "for supported models, translate_function is not required")."""
    if translate is None:
        from smp_compat.nn.huggingface import from_hf_translator

        translate = from_hf_translator(module, sd)
    return sd if translate is None else translate(sd)


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
    if pipelined(model):
        current = model.module.state_dict(keep_vars=True)
        owners = _key_owners(model, current)
        me = my_pp_rank()
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
        result = model.module.load_state_dict(prepared, strict=strict)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{exc}\nLoad a dict saved from this model, pass translate_function=... to rename keys, or "
            "strict=False to load the matching keys only."
        ) from exc
    _refresh_masters(model, prepared)
    return result


def _refresh_masters(model: Any, loaded: Mapping[str, Any]) -> None:
    """fp16/bf16 masters made before this load follow the loaded weights, or the next step would undo it."""
    refresh = getattr(state.optimizer, "refresh_masters", None)
    if callable(refresh):
        named = model.module.named_parameters(remove_duplicate=False)
        refresh([p for name, p in named if name in loaded])


def _same_partition(model: Any, info: Any) -> bool:
    """The part was saved by this very layout: same degrees and the same module-to-rank assignment."""
    if not isinstance(info, Mapping):
        return False
    topo = state.topology
    if info.get("pipeline_parallel_degree") != topo.pp_size or info.get("tensor_parallel_degree", 1) != topo.tp_size:
        return False
    if not pipelined(model):
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
    if all(allgather_pp(direct)):
        entries = strip_wrapper_prefix(strip_markers(part), model.module.state_dict(keep_vars=True).keys())
        return _load_now(model, entries, strict, fill_non_local=True)
    parts = allgather_pp(to_cpu(strip_markers(part)))
    merged = strip_wrapper_prefix(merge_model_parts(parts), model.module.state_dict(keep_vars=True).keys())
    return _load_now(model, merged, strict, fill_non_local=False)


def apply_model_load(model: Any, pending: PendingModelLoad) -> None:
    if is_partial(pending.state_dict):
        _load_partial_now(model, pending.state_dict, pending.strict, pending.same_partition_load)
    else:
        _load_now(model, pending.state_dict, pending.strict, fill_non_local=False)
