"""Optimizer state dicts across pipeline ranks: full (every rank's state by parameter name), local, loads.

Parameters are identified by name, never by torch's index alone, so a dict saved under one partition, fp16
setting or optimizer-state sharding loads under another. Loads before partitioning wait for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn

from smp_compat.checkpoints.pp_gather import allgather_pp, gather
from smp_compat.checkpoints.state_dicts import (
    PARAM_NAMES_KEY,
    PARTIAL_KEY,
    is_partial,
    pipelined,
    to_cpu,
    to_device,
)
from smp_compat.comm import all_gather_objects, object_device
from smp_compat.errors import CheckpointError
from smp_compat.globalstate import process_group, state

__all__ = [
    "apply_pending_optimizer_loads",
    "load_optimizer_state",
    "merge_optimizer_parts",
    "optimizer_local_state_dict",
    "optimizer_state_dict",
    "record_added_group",
    "record_param_order",
]


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


def record_added_group(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> None:
    """At ``add_param_group`` after ``DistributedOptimizer``: the user's groups gain it, or full dicts drop it."""
    canonical = {id(p): n for n, p in state.model.module.named_parameters()}
    _full_groups(optimizer).append([canonical[id(p)] for p in params])


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
    local = {id(p) for _, p in model.local_named_parameters()} if pipelined(model) else None
    names, mine = [], set()
    for i, p in enumerate(_optimizer_params(optimizer)):
        source = aliases.get(id(p), p)
        names.append(canonical.get(id(source), f"<unnamed parameter {i}>"))
        if local is None or id(source) in local:
            mine.add(i)
    return names, mine


def optimizer_local_state_dict(
    optimizer: torch.optim.Optimizer, original_state_dict: Callable[[], dict], gather_if_shard: bool = False
) -> dict:
    """Torch's dict with the state of this rank's parameters only, marked partial, with parameter names.

    The names (one per torch index) let the state find its parameters again after a restart or
    under another partition, and let the parts be merged into one plain dict. Indices and groups are the
    user's optimizer's even where sharding or fp16 masters changed this rank's groups: every part then
    describes the same optimizer, so merged parts keep the user's parameter order and group membership.
    ``gather_if_shard`` (SMP's argument) with ``shard_optimizer_state``: the state of every rdp rank's share.
    """
    sd = _local_state_dict(optimizer, original_state_dict)
    if gather_if_shard and state.cfg.shard_optimizer_state and state.topology.rdp_size > 1:
        sd = _with_every_share(optimizer, sd)
    return sd


def _with_every_share(optimizer: torch.optim.Optimizer, sd: dict) -> dict:
    """Collective over the rdp group: the states of all rdp ranks' shares of this (pp, tp) rank's parameters,
    as one dict, as SMP gathered them for a script that saves from rdp_rank 0 only (AWS's GPT-2 script)."""
    mine = {sd[PARAM_NAMES_KEY][i]: to_cpu(s) for i, s in sd["state"].items()}
    named: dict[str, Any] = {}
    for part in all_gather_objects(mine, process_group("rdp"), state.topology.rdp_size, object_device()):
        named.update(part)
    flat = list(chain.from_iterable(_full_groups(optimizer)))
    out = {k: v for k, v in sd.items() if k not in ("state", "param_groups", PARAM_NAMES_KEY)}
    return {**out, **_plain_dict(optimizer, named), PARAM_NAMES_KEY: flat}


def _local_state_dict(optimizer: torch.optim.Optimizer, original_state_dict: Callable[[], dict]) -> dict:
    """This rank's own entries (see ``optimizer_local_state_dict``)."""
    sd = dict(original_state_dict())
    names, mine = _current_params(optimizer)
    sd["state"] = {i: s for i, s in sd["state"].items() if i in mine}
    sd[PARTIAL_KEY] = True
    sd[PARAM_NAMES_KEY] = names
    flat = list(chain.from_iterable(_full_groups(optimizer)))
    index = {n: i for i, n in enumerate(flat)}
    if names != flat and len(index) == len(flat) and all(names[i] in index for i in sd["state"]):
        sd["state"] = {index[names[i]]: s for i, s in sd["state"].items()}
        sd["param_groups"] = _user_groups(optimizer)
        sd[PARAM_NAMES_KEY] = flat
    return sd


def _user_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups as the user built them (torch's indices over all parameters), hyperparameters from now."""
    groups, start = [], 0
    for names, group in zip(_full_groups(optimizer), optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k not in _GROUP_LIST_KEYS}
        groups.append({**hyper, "params": list(range(start, start + len(names)))})
        start += len(names)
    return groups


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
    flat = list(chain.from_iterable(_full_groups(optimizer)))
    return {"state": {i: states[n] for i, n in enumerate(flat) if n in states}, "param_groups": _user_groups(optimizer)}


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
    if not pipelined(model) and names == list(chain.from_iterable(_full_groups(optimizer))):
        return original_state_dict()
    local = optimizer_local_state_dict(optimizer, original_state_dict)
    named = {local[PARAM_NAMES_KEY][i]: to_cpu(s) for i, s in local["state"].items()}
    parts = gather(named, to_root=gather_to_rank0)
    if parts is None:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    if not cast_to_cpu:
        merged = {n: to_device(s, state.device) for n, s in merged.items()}
    return _plain_dict(optimizer, merged)


def merge_optimizer_parts(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One plain torch optimizer dict from per-rank parts (the converter; no optimizer object at hand).

    With parameter names, index i of the result is the i-th name in the first part's order (kept under
    ``_smp_param_names``, which torch's loader ignores), and the groups and hyperparameters come from the
    first part; without names, torch indices are kept.
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
    states = {i: named[n] for i, n in enumerate(order) if n in named}
    return {"state": states, "param_groups": groups, PARAM_NAMES_KEY: order}  # names: loads by name, splits again


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
        if not all(allgather_pp(all(n in local_names for n in states))):
            states = {}
            for part in allgather_pp(to_cpu(_by_name(sd, saved_names))):
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

_PENDING_OPTIMIZERS: list[tuple[Any, weakref.ref]] = []
"""Optimizers whose load waits for partitioning, with the launch they belong to."""

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
