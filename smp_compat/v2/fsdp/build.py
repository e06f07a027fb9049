"""``FullyShardedDataParallel(model, ...)`` after ``tsm.init()``: the same model, sharded by FSDP2.

Each FSDP1 keyword maps to FSDP2 (docs/design.md, "SMP v2's FSDP call"):
``auto_wrap_policy`` picks the units that get their own ``fully_shard`` (then the root gets one);
``mixed_precision`` becomes a ``MixedPrecisionPolicy``; ``sharding_strategy`` with ``hybrid_shard_degree``
picks the mesh and ``reshard_after_forward`` (layout.py); ``param_init_fn`` materializes meta modules one
unit at a time, as FSDP1 does, and ``post_param_init_fn`` (SMP's keyword) runs after each unit;
``sync_module_states`` copies the source rank's values (broadcast.py); ``forward_prefetch`` becomes explicit
forward prefetching; ``backward_prefetch`` and ``limit_all_gathers`` are what FSDP2 always does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import StateDictType
from torch.distributed.fsdp.api import OptimStateDictConfig, StateDictConfig
from torch.distributed.tensor import DTensor

from smp_compat.errors import SMPUnsupportedError
from smp_compat.host.torch_floor import check_sharding
from smp_compat.v2.fsdp import broadcast, policies
from smp_compat.v2.fsdp.context import Context
from smp_compat.v2.fsdp.layout import FsdpLayout, resolve

__all__ = ["FacadeState", "build", "facade_state"]

_POSITIONAL = (
    "process_group", "sharding_strategy", "cpu_offload", "auto_wrap_policy", "backward_prefetch", "mixed_precision",
    "ignored_modules", "param_init_fn", "device_id", "sync_module_states", "forward_prefetch", "limit_all_gathers",
    "use_orig_params", "ignored_states", "device_mesh",
)  # fmt: skip
"""FSDP1's parameters after ``module``, in its order (torch 2.13)."""
_ACCEPTED = {*_POSITIONAL, "post_param_init_fn"}


@dataclass
class FacadeState:
    """What FSDP1 kept on its root: the layout, the settings, and the current state-dict type."""

    layout: FsdpLayout
    mixed_precision: MixedPrecision | None
    units: list[nn.Module]
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT  # FSDP1's default
    state_dict_config: StateDictConfig | None = None
    optim_state_dict_config: OptimStateDictConfig | None = None


def facade_state(module: nn.Module) -> FacadeState | None:
    """The façade state of ``module`` if it is a root the façade built."""
    return module.__dict__.get("_smp_fsdp")


def build(ctx: Context, module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """Shard ``module`` as the FSDP1 call describes; return it with FSDP1's attributes set."""
    check_sharding("SMP v2's FullyShardedDataParallel (served by FSDP2)")
    kw = _keywords(args, kwargs)
    _refuse(kw)
    layout = resolve(ctx, kw.get("sharding_strategy"))
    ctx.report_resolved(layout.group_size)
    device = _device(ctx, kw.get("device_id"))
    units = policies.units(module, kw.get("auto_wrap_policy"))
    mp = kw.get("mixed_precision")
    options = _fully_shard_options(layout, mp, kw.get("cpu_offload"))
    init_fn, post_fn = kw.get("param_init_fn"), kw.get("post_param_init_fn")
    done: set[int] = set()
    for unit in units + [module]:
        own = _own_modules(unit, done)
        _materialize(own, device, init_fn)
        if post_fn is not None:
            post_fn(unit)
        _cast_buffers(own, mp)
        _to_device(own, device)
        if kw.get("sync_module_states"):
            broadcast.sync_from_source(ctx, layout, own)
        done.update(id(m) for m in own)
        _shard_experts(own, layout, options)
        fully_shard(unit, reshard_after_forward=layout.reshard_after_forward if unit is not module else False,
                    **options)  # fmt: skip
    if kw.get("forward_prefetch"):
        for first, second in zip(units, units[1:]):
            first.set_modules_to_forward_prefetch([second])
    _attach(module, layout, mp, units)
    return module


def _shard_experts(own: list[nn.Module], layout: FsdpLayout, options: dict[str, Any]) -> None:
    """Expert parallelism: each MoE layer's experts get their own unit on the experts' mesh (moe/ep.py)."""
    if layout.expert_mesh is None:
        return
    from smp_compat.v2.moe.moe_layer import LocalExperts

    for m in own:
        if isinstance(m, LocalExperts):
            fully_shard(m, **{**options, "mesh": layout.expert_mesh},
                        reshard_after_forward=layout.reshard_after_forward)  # fmt: skip
            m.grad_scale = layout.expert_mesh.size() / layout.mesh.size()  # FSDP averages over fewer ranks


def _keywords(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"FullyShardedDataParallel() takes at most {len(_POSITIONAL) + 1} positional arguments")
    kw = dict(zip(_POSITIONAL, args))
    unknown = set(kwargs) - _ACCEPTED
    if unknown:
        raise TypeError(f"FullyShardedDataParallel() got unexpected keyword argument(s) {sorted(unknown)}")
    kw.update(kwargs)
    return kw


def _refuse(kw: dict[str, Any]) -> None:
    """Keywords whose FSDP1 meaning the SMP v2 layout replaces or FSDP2 lacks: one error each."""
    for name, why in (
        ("process_group", "the groups come from tsm's hybrid_shard_degree"),
        ("device_mesh", "the mesh comes from tsm.init()"),
        ("ignored_modules", "FSDP2 has ignored parameters, not modules"),
        ("ignored_states", "FSDP2 has ignored parameters, not modules"),
    ):
        if kw.get(name) is not None:
            raise SMPUnsupportedError(f"FullyShardedDataParallel({name}=...) after tsm.init(): {why}; leave it out.")
    mp = kw.get("mixed_precision")
    if mp is not None and mp.keep_low_precision_grads:
        raise SMPUnsupportedError("MixedPrecision(keep_low_precision_grads=True) after tsm.init(): FSDP2 keeps fp32 "
                                  "gradients on fp32 parameters.")  # fmt: skip


def _device(ctx: Context, device_id: Any) -> torch.device:
    if ctx.mesh.device_type == "cpu":
        return torch.device("cpu")
    if isinstance(device_id, torch.device) and device_id.index is not None:
        return device_id
    index = device_id if isinstance(device_id, int) else torch.accelerator.current_device_index()
    return torch.device(ctx.mesh.device_type, index)


def _fully_shard_options(layout: FsdpLayout, mp: MixedPrecision | None, offload: CPUOffload | None) -> dict[str, Any]:
    policy = MixedPrecisionPolicy()
    if mp is not None:
        policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    options: dict[str, Any] = {"mesh": layout.mesh, "mp_policy": policy}
    if offload is not None and offload.offload_params and layout.mesh.device_type != "cpu":
        options["offload_policy"] = CPUOffloadPolicy()  # on a CPU job the parameters already live there
    return options


def _own_modules(unit: nn.Module, done: set[int]) -> list[nn.Module]:
    """The unit's modules not in an inner unit, breadth first from the unit (FSDP1's materialization order)."""
    found, queue, seen = [], collections.deque([unit]), {id(unit)}
    while queue:
        m = queue.popleft()
        found.append(m)
        for child in m.children():
            if id(child) not in seen and id(child) not in done:
                seen.add(id(child))
                queue.append(child)
    return found


def _is_meta(m: nn.Module) -> bool:
    tensors = [*m._parameters.values(), *m._buffers.values()]
    return any(t is not None and t.is_meta for t in tensors)


def _materialize(modules: list[nn.Module], device: torch.device, init_fn: Callable[[nn.Module], None] | None) -> None:
    """FSDP1's rule: with meta tensors, ``param_init_fn(module)``, else ``to_empty`` and ``reset_parameters``."""
    if not any(_is_meta(m) for m in modules):
        return
    for m in modules:
        if init_fn is not None:
            init_fn(m)
        elif _is_meta(m):
            m.to_empty(device=device, recurse=False)
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()


def _to_device(modules: list[nn.Module], device: torch.device) -> None:
    """FSDP1 moves each unit to ``device_id`` before syncing it (NCCL broadcasts GPU tensors only)."""
    if device.type == "cpu":
        return
    with torch.no_grad():
        for m in modules:
            for p in m._parameters.values():
                if p is not None and p.device != device and not isinstance(p, DTensor):
                    p.data = p.data.to(device)
            for name, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[name] = b.to(device)


def _cast_buffers(modules: list[nn.Module], mp: MixedPrecision | None) -> None:
    """``MixedPrecision.buffer_dtype``: floating buffers take it (FSDP2 leaves buffers alone)."""
    if mp is None or mp.buffer_dtype is None:
        return
    for m in modules:
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != mp.buffer_dtype:
                m._buffers[name] = b.to(mp.buffer_dtype)


def _attach(module: nn.Module, layout: FsdpLayout, mp: MixedPrecision | None, units: list[nn.Module]) -> None:
    """FSDP1's public attributes the scripts read, and the façade's own state."""
    module.__dict__["_smp_fsdp"] = FacadeState(layout, mp, units)
    module.__dict__["process_group"] = layout.process_group
    module.__dict__["rank"] = dist.get_rank(layout.process_group)
    module.__dict__["world_size"] = dist.get_world_size(layout.process_group)
    module.__dict__["sharding_strategy"] = layout.strategy
    module.__dict__["mixed_precision"] = mp
    module.__dict__["clip_grad_norm_"] = functools.partial(_clip_grad_norm, module)
    module.__dict__["no_sync"] = functools.partial(_no_sync, module)


def _clip_grad_norm(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """FSDP1's ``model.clip_grad_norm_``: the global norm over every shard and tp piece."""
    from smp_compat.v2.grad_norm import clip_grad_norm_

    return clip_grad_norm_(module, max_norm, norm_type)


@contextlib.contextmanager
def _no_sync(module: nn.Module) -> Iterator[None]:
    """FSDP1's ``no_sync()``: accumulate gradients locally; the next backward outside it reduces them."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
