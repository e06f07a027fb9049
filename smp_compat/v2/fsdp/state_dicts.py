"""FSDP1's state-dict types on an FSDP2 model — the contract the checkpoint code builds on.

Inside ``FSDP.state_dict_type(model, T, cfg)``, ``model.state_dict()`` of the façade root (or of any
wrapper around it: activation checkpointing, ``offload_wrapper``) gives Hugging Face keys (no ``_fsdp`` or
``_checkpoint_wrapped_module`` parts) and:

* ``SHARDED_STATE_DICT``: the parameters as FSDP2's DTensors (data-parallel shards, tensor-parallel pieces
  on the same root mesh), which DCP saves and loads in place, at any other shard degree;
  ``load_state_dict`` takes DTensors of the same layout (what ``dcp.load`` filled).
* ``FULL_STATE_DICT``: plain full tensors (``full_tensor()``, a collective every rank joins); with
  ``FullStateDictConfig(rank0_only=True)`` only global rank 0 keeps them, the others get ``{}``;
  ``offload_to_cpu`` moves them to the CPU. ``load_state_dict`` takes full tensors on every rank.
* ``LOCAL_STATE_DICT``: this rank's own pieces as plain tensors (``to_local()``), no collective; loading
  needs the same layout.

Buffers are plain tensors in every type. ``FSDP.optim_state_dict(model, optim)`` gives the optimizer
state keyed by parameter name as torch's distributed ``get_optimizer_state_dict`` does (DTensor states for
sharded, plain full ones for full), and ``FSDP.optim_state_dict_to_load(model, optim, osd)`` loads ``osd``
into ``optim`` (``set_optimizer_state_dict``) and returns ``optim.state_dict()``, so the script's
``optimizer.load_state_dict(result)`` that follows restores exactly what was saved.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp.api import FullOptimStateDictConfig, OptimStateDictConfig, StateDictConfig
from torch.distributed.tensor import DTensor

from smp_compat.v2.fsdp.build import FacadeState, facade_state
from smp_compat.v2.fsdp.reshard import reshard_tree
from smp_compat.v2.moe.ep import own_experts, whole_experts
from smp_compat.v2.moe.hf4 import from_hf4_names, to_hf4_names

__all__ = ["install_hooks", "roots_in", "use_type", "optim_state_dict", "optim_state_dict_to_load"]


def roots_in(module: nn.Module) -> list[nn.Module]:
    """Façade roots in ``module``'s tree (the script may hold a wrapper around one)."""
    return [m for m in module.modules() if facade_state(m) is not None]


@contextlib.contextmanager
def use_type(
    roots: list[nn.Module], kind: StateDictType, cfg: StateDictConfig | None, optim_cfg: OptimStateDictConfig | None
) -> Iterator[None]:
    """Set the state-dict type on the roots for the block, then restore the previous one (as FSDP1).
    The trees are resharded first, so the block sees the parameters the optimizer holds (reshard.py)."""
    for r in roots:
        reshard_tree(r)
    states = [facade_state(r) for r in roots]
    saved = [(s.state_dict_type, s.state_dict_config, s.optim_state_dict_config) for s in states]
    for s in states:
        set_type(s, kind, cfg, optim_cfg)
    try:
        yield
    finally:
        for s, (k, c, o) in zip(states, saved):
            s.state_dict_type, s.state_dict_config, s.optim_state_dict_config = k, c, o


def set_type(
    s: FacadeState, kind: StateDictType, cfg: StateDictConfig | None, optim_cfg: OptimStateDictConfig | None
) -> None:
    s.state_dict_type, s.state_dict_config, s.optim_state_dict_config = kind, cfg, optim_cfg


def install_hooks(root: nn.Module) -> None:
    """Register the root's state-dict post-hook and load pre-hook that apply the current type."""
    root._register_state_dict_hook(_after_state_dict)
    root._register_load_state_dict_pre_hook(_before_load, with_module=True)


def _is_full(s: FacadeState) -> bool:
    return s.state_dict_type is StateDictType.FULL_STATE_DICT


def _after_state_dict(module: nn.Module, sd: dict[str, Any], prefix: str, _meta: Any) -> dict[str, Any]:
    s = facade_state(module)
    kind = s.state_dict_type
    if kind is StateDictType.SHARDED_STATE_DICT:
        return sd
    keys = [k for k in sd if k.startswith(prefix)]
    if kind is StateDictType.LOCAL_STATE_DICT:
        for k in keys:
            if isinstance(sd[k], DTensor):
                sd[k] = sd[k].to_local()
        return sd
    cfg = s.state_dict_config if isinstance(s.state_dict_config, FullStateDictConfig) else FullStateDictConfig()
    keep = not cfg.rank0_only or dist.get_rank() == 0
    with _quiet_redistribution():
        for k in keys:
            value = sd[k]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if isinstance(value, DTensor):  # expert parallelism: every ep rank's experts (moe/ep.py)
                full = whole_experts(full, value.device_mesh)
            if not keep:
                del sd[k]
                continue
            sd[k] = full.detach().cpu() if cfg.offload_to_cpu else full.detach()
    to_hf4_names(sd, prefix)  # transformers 4.x Mixtral's per-expert names (moe/hf4.py)
    return sd


@contextlib.contextmanager
def _quiet_redistribution() -> Iterator[None]:
    """Gathering a tp x FSDP parameter logs, per parameter, that it takes two all-gathers (it must: the FSDP
    shard is strided over the tp one); one warning per tensor of a full save is noise, so it is silenced."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _before_load(module: nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
    """Full and local values become DTensors of the parameter's layout, so FSDP2's copy takes them."""
    s = facade_state(module)
    if s.state_dict_type is StateDictType.SHARDED_STATE_DICT:
        return
    targets = {prefix + n: t for n, t in _named_tensors(module)}
    if _is_full(s):
        from_hf4_names(sd, set(targets))  # transformers 4.x Mixtral's per-expert names (moe/hf4.py)
    for k, value in list(sd.items()):
        target = targets.get(k)
        if not isinstance(target, DTensor) or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            continue
        value = value.to(device=target.device, dtype=target.dtype)
        if _is_full(s):
            sd[k] = _piece_of(own_experts(value, target.device_mesh), target)
        else:
            sd[k] = DTensor.from_local(value, target.device_mesh, target.placements, shape=target.shape,
                                       stride=target.stride())  # fmt: skip


def _piece_of(full: torch.Tensor, target: DTensor) -> DTensor:
    """This rank's part of ``full`` in ``target``'s layout (every rank holds ``full``)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters by their state-dict key (checkpoint wrappers removed, as the state dict shows them)."""
    for name, p in module.named_parameters(remove_duplicate=False):
        yield name.replace("_checkpoint_wrapped_module.", ""), p


def _options(s: FacadeState, for_load: bool) -> tuple[StateDictOptions, bool]:
    """DSD options for the current type, and whether only rank 0 keeps the result."""
    if not _is_full(s):
        return StateDictOptions(), False
    cfg = s.optim_state_dict_config
    rank0 = bool(isinstance(cfg, FullOptimStateDictConfig) and cfg.rank0_only)
    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=rank0 and for_load), rank0


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, root: nn.Module) -> dict[str, Any]:
    """``FSDP.optim_state_dict`` for a façade model: the optimizer state keyed by parameter name."""
    s = facade_state(root)
    options, rank0 = _options(s, for_load=False)
    reshard_tree(model)  # a forward with no backward left unsharded parameters registered (reshard.py)
    osd = get_optimizer_state_dict(model, optim, options=options)
    cfg = s.optim_state_dict_config
    if _is_full(s) and cfg is not None and cfg.offload_to_cpu:
        osd = _to_cpu(osd)
    if rank0 and dist.get_rank() != 0:
        return {}
    return osd


def optim_state_dict_to_load(
    model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any], root: nn.Module
) -> dict[str, Any]:
    """``FSDP.optim_state_dict_to_load``: load ``osd`` into ``optim``, return what ``optim.load_state_dict`` takes."""
    options, _ = _options(facade_state(root), for_load=True)
    reshard_tree(model)
    if not options.full_state_dict:
        osd = _sharded_tensors_to_dtensors(model, osd)
    set_optimizer_state_dict(model, optim, osd, options=options)
    return optim.state_dict()


def _sharded_tensors_to_dtensors(model: nn.Module, osd: dict[str, Any]) -> dict[str, Any]:
    """``load_sharded_optimizer_state_dict`` returns ShardedTensors chunked over the job (it predates
    DTensor layouts); each becomes a DTensor in its parameter's layout. Every rank joins each gather."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    params = dict(_named_tensors(model))
    state = {}
    for fqn, entries in osd.get("state", {}).items():
        target = params.get(fqn)
        state[fqn] = {
            k: _as_layout(v, target) if isinstance(v, ShardedTensor) else v for k, v in entries.items()
        }
    return {**osd, "state": state}


def _as_layout(st: Any, target: torch.Tensor | None) -> torch.Tensor:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    shards = st.local_shards()
    size = st.size()
    group = st._process_group
    device = shards[0].tensor.device if shards else torch.device(dist.distributed_c10d._get_pg_default_device(group))
    local = shards[0].tensor if shards else torch.empty((0, *size[1:]), dtype=st.dtype, device=device)
    mesh = DeviceMesh.from_group(group, device.type)
    full = DTensor.from_local(local, mesh, [Shard(0)], shape=size, stride=_contiguous_stride(size)).full_tensor()
    if isinstance(target, DTensor):
        return _piece_of(full.to(target.device), target)
    return full


def _contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(size):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _to_cpu(value: Any) -> Any:
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.cpu(), value)
