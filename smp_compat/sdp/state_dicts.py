"""State dicts of a sharded model and optimizer, through torch.distributed.checkpoint.state_dict.

``model.state_dict()`` gathers real full tensors on every rank (SMP returned placeholders under
sharded DP); ``local_state_dict()`` returns the sharded form (DTensor values, this rank's shards),
which is what DCP saves and reshards on load. Keys are the user module's own parameter names, as
plain PyTorch's; optimizer state is keyed by the same names (DCP's form). Under tensor parallelism the
full forms are also gathered over the tp group (and loading a full form cuts each tp rank's slice).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from smp_compat.checkpoints import state_dicts as common
from smp_compat.errors import CheckpointError
from smp_compat.sdp.tp import tp_size

__all__ = [
    "full_model_state_dict",
    "sharded_model_state_dict",
    "load_model_state_dict",
    "full_optimizer_state_dict",
    "sharded_optimizer_state_dict",
    "load_optimizer_state_dict",
    "attach_ds_views",
]


def _to_cpu(value: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, value)


def _is_sharded(value: Any) -> bool:
    found = False

    def visit(t: Any) -> Any:
        nonlocal found
        found = found or isinstance(t, DTensor)
        return t

    tree_map(visit, value)
    return found


def full_model_state_dict(model: Any, cast_to_cpu: bool = True) -> dict[str, Any]:
    """Every entry as a full tensor on every rank (collective over the data-parallel group)."""
    sd = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))
    if tp_size() > 1:  # whole over rdp, still this tp rank's slices: gather those over the tp group
        from smp_compat.nn.state import gather_shards

        sd = dict(gather_shards(model.module, sd))
    return _to_cpu(sd) if cast_to_cpu else sd


def sharded_model_state_dict(model: Any) -> dict[str, Any]:
    """Parameters as DTensors holding this rank's shards; buffers as plain tensors."""
    return get_model_state_dict(model.module)


def load_model_state_dict(
    model: Any, state_dict: Mapping[str, Any], strict: bool = True,
    translate_function: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> Any:
    """Load a full dict (plain tensors, e.g. a plain PyTorch or HF checkpoint) or a sharded one; a full one with
    Hugging Face's names is translated into a swapped model, as without sharding."""
    sd: Mapping[str, Any] = common.strip_markers(state_dict)
    full = not _is_sharded(sd)
    if full:
        sd = common.translate_full(model.module, sd, translate_function)
    elif translate_function is not None:
        sd = translate_function(sd)
    expected = list(model.module.state_dict().keys())
    sd = dict(common.strip_wrapper_prefix(sd, expected))
    if full and tp_size() > 1:  # whole tensors are cut to this tp rank's slices first
        from smp_compat.nn.state import slice_for_rank

        sd = dict(slice_for_rank(model.module, sd))
    result = set_model_state_dict(
        model.module, {k: v for k, v in sd.items()}, options=StateDictOptions(full_state_dict=full, strict=strict)
    )
    attach_ds_views(model.module)
    return result


def _tp_optimizer_state(model: Any, state: Mapping[str, Any], convert: Callable[..., Any]) -> dict[str, Any]:
    """``state`` with each tp shard's moments passed through ``convert`` (gather or slice, nn/state.py).

    Per state key (``exp_avg``, ...), the entries shaped like their parameter form a name-keyed dict that
    ``convert`` treats as it treats the model's own (collective over tp for a gather); scalars stay.
    """
    out = {name: dict(entry) for name, entry in state.items()}
    keys = sorted({k for entry in out.values() for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim()})
    for key in keys:
        column = {n: e[key] for n, e in out.items() if isinstance(e.get(key), torch.Tensor) and e[key].dim()}
        for name, value in convert(model.module, column).items():
            out[name][key] = value
    return out


def full_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, cast_to_cpu: bool = True) -> dict[str, Any]:
    """Whole tensors keyed by parameter name (collective over the job: rdp by FSDP2, then tp)."""
    sd = get_optimizer_state_dict(model.module, optimizer, options=StateDictOptions(full_state_dict=True))
    if tp_size() > 1:
        from smp_compat.nn.state import gather_shards

        sd = {**sd, "state": _tp_optimizer_state(model, sd["state"], gather_shards)}
    return _to_cpu(sd) if cast_to_cpu else sd


def sharded_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(model.module, optimizer)


def load_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError(
            "optimizer.load_state_dict() under sharded data parallelism takes a dict from optimizer.state_dict() "
            "or optimizer.local_state_dict() of a sharded job (keys 'state' and 'param_groups')."
        )
    full = not _is_sharded(state_dict["state"])
    if full and tp_size() > 1:  # whole moments are cut to this tp rank's slices first
        from smp_compat.nn.state import slice_for_rank

        state_dict = {**state_dict, "state": _tp_optimizer_state(model, state_dict["state"], slice_for_rank)}
    set_optimizer_state_dict(  # not strict: a parameter that never had a gradient has no state, as in plain PyTorch
        model.module, optimizer, dict(state_dict), options=StateDictOptions(full_state_dict=full, strict=False)
    )


def attach_ds_views(root: nn.Module) -> None:
    """DeepSpeed-style attributes AWS scripts read: ``p.ds_shape``, ``p.ds_numel``, ``p.ds_tensor.ds_numel``.

    ``ds_tensor`` is this rank's local shard (a view of the parameter's storage), ``ds_numel`` its
    element count; ``ds_shape``/``ds_numel`` on the parameter are the full shape and size. Refreshed
    after every load, which may give the shard new storage.
    """
    for p in root.parameters():
        if isinstance(p, DTensor):
            local = p.to_local()
            local.ds_numel = local.numel()  # type: ignore[attr-defined]
            p.ds_tensor = local  # type: ignore[attr-defined]
            p.ds_shape = p.shape  # type: ignore[attr-defined]
            p.ds_numel = p.numel()  # type: ignore[attr-defined]
