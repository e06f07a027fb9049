"""Sharding the model at ``smp.DistributedModel(...)``: one FSDP2 unit per block, root last.

SMP sharded eagerly (scripts build their optimizer's parameter groups right after wrapping), so this
runs in the DistributedModel constructor. Units are the children of every ``nn.ModuleList`` and of
``smp.nn``'s ``seq_layers`` (the transformer blocks of HF, swapped and AWS models) or, for a model
without either, its direct children. A unit
that shares a parameter with anything outside it (tied embeddings and heads, ``smp.register_parameter``)
is left to the root unit, so a shared parameter always lives in one FSDP group (torch >= 2.13 refuses
otherwise). Delayed-initialization models are materialized one unit at a time and sharded at once,
so a rank holds at most one unit's full parameters besides its shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from smp_compat.stepping import grads
from smp_compat.memory.materialize import check_initialized, materialize_local
from smp_compat.errors import StepUsageError
from smp_compat.globalstate import process_group, state
from smp_compat.host.torch_floor import check_sharding
from smp_compat.precision.module16 import sixteen_bit_dtype
from smp_compat.sdp.masters import sixteen_bit_training, upcast_parameters
from smp_compat.sdp.mesh import build_mesh
from smp_compat.sdp.tp import is_tp_shard, restore_tp_marks, tp_marks

__all__ = ["shard_module", "choose_units", "registered_pairs", "register_parameter"]

_registered: list[tuple[Any, nn.Module, nn.Parameter]] = []  # (launch, module, parameter)


def registered_pairs() -> list[tuple[nn.Module, nn.Parameter]]:
    """``smp.register_parameter(module, p)`` calls of this job: ``module`` uses ``p`` owned elsewhere."""
    return [(m, p) for launch, m, p in _registered if launch is state.launch]


def register_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """SMP 1.15: ``module``'s forward uses ``parameter``, owned by another module; keep them in one unit.

    Call it before ``smp.DistributedModel(...)``, which shards. Without sharded DP it changes nothing.
    """
    if not isinstance(module, nn.Module) or not isinstance(parameter, torch.Tensor):
        raise TypeError("smp.register_parameter(module, parameter) takes an nn.Module and one of the model's parameters.")
    if state.initialized and state.model is not None and getattr(state.model, "_sdp_units", None) is not None:
        raise StepUsageError(
            "smp.register_parameter() was called after smp.DistributedModel(...), which already sharded the model; "
            "call it before wrapping, as SMP's sharded data parallelism requires."
        )
    _registered.append((state.launch if state.initialized else None, module, parameter))


def choose_units(root: nn.Module) -> list[nn.Module]:
    """Blocks to shard one by one, in forward order; shared-parameter blocks are left to the root."""
    candidates = _candidates(root)
    owners: dict[int, list[nn.Module]] = {}
    for unit in candidates:
        for p in unit.parameters():
            owners.setdefault(id(p), []).append(unit)
    outside = _params_outside(root, candidates)
    pairs = registered_pairs()
    extra = {id(p): m for m, p in pairs}
    return [
        u for u in candidates
        if all(len(owners[id(p)]) == 1 and id(p) not in outside for p in u.parameters())
        and not any(id(p) in extra and not _contains(u, extra[id(p)]) for p in u.parameters())
        and not any(_contains(u, m) and not _owns(u, p) for m, p in pairs)
    ]  # fmt: skip


def _candidates(root: nn.Module) -> list[nn.Module]:
    stacks = _layer_stacks(root)
    lists = [m for m in root.modules() if isinstance(m, nn.ModuleList) or id(m) in stacks]
    if lists:
        found: list[nn.Module] = []
        for ml in lists:
            if not any(_contains(f, ml) for f in found):
                found.extend(c for c in ml if any(True for _ in c.parameters()))
        return found
    return [c for c in root.children() if any(True for _ in c.parameters())]


def _layer_stacks(root: nn.Module) -> set[int]:
    """ids of ``smp.nn.DistributedTransformer.seq_layers`` (an ``nn.Sequential``, as SMP's): its layers are blocks."""
    return {id(m.seq_layers) for m in root.modules() if isinstance(getattr(m, "seq_layers", None), nn.Sequential)}


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _owns(unit: nn.Module, p: nn.Parameter) -> bool:
    return any(q is p for q in unit.parameters())


def _params_outside(root: nn.Module, units: list[nn.Module]) -> set[int]:
    """ids of parameters also reachable from modules that are in no candidate unit."""
    inside = {id(m) for u in units for m in u.modules()}
    out: set[int] = set()
    for m in root.modules():
        if id(m) not in inside:
            out.update(id(p) for p in m.parameters(recurse=False))
    return out


def mixed_precision() -> MixedPrecisionPolicy:
    """fp32 sharded masters (masters.py); 16-bit gathers and compute when the config asks for it.

    Gradients are reduce-scattered in fp32: each rank's 16-bit gradient is summed without a second
    rounding, so the fp32 master gradient is the 16-bit backward's, as in a single-process run with fp32
    masters (the 16-bit oracle), and an fp16 sum of scaled gradients cannot overflow where no rank did.
    """
    if sixteen_bit_training():
        # outputs: DistributedModel.forward
        return MixedPrecisionPolicy(param_dtype=sixteen_bit_dtype(), reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_module(root: nn.Module, broadcast_buffers: bool = True) -> list[nn.Module]:
    """Materialize (if delayed), make replicas equal, and ``fully_shard`` each unit then the root."""
    check_sharding("sharded data parallelism (sharded_data_parallel_degree)")
    mesh = build_mesh()
    policy = mixed_precision()
    units = choose_units(root)
    marks = tp_marks(root)
    if not any(t.is_meta for t in root.parameters()):
        root.to(state.device)  # as at pp = 1: the full model on this rank's device until it is sharded
    for unit in units:
        _prepare(root, list(unit.modules()), broadcast_buffers)
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    in_units = {id(m) for u in units for m in u.modules()}
    _prepare(root, [m for m in root.modules() if id(m) not in in_units], broadcast_buffers)
    check_initialized(root)  # now: a load after sharding goes into the shards, which this check cannot see
    fully_shard(root, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    restore_tp_marks(root, marks)
    return units


def _prepare(root: nn.Module, modules: list[nn.Module], broadcast_buffers: bool) -> None:
    """Allocate delayed modules, move them to the device, and copy dp rank 0's values (SMP's replica sync)."""
    materialize_local(root, modules, state.device)
    if sixteen_bit_training():
        upcast_parameters(modules)  # fp32 masters before fully_shard: the shards keep this dtype
    for m in modules:
        for name, b in m._buffers.items():
            if b is not None and b.device != state.device:
                m._buffers[name] = b.to(state.device)
    own = [t for m in modules for t in m._parameters.values() if t is not None and not _is_dtensor(t)]
    if broadcast_buffers:
        own += [b for m in modules for b in m._buffers.values() if b is not None]
    topo = state.topology
    unique = list({id(t): t for t in own}.values())
    shards = [t.data for t in unique if is_tp_shard(t)]  # each tp rank keeps its own slice: synced over rdp
    rest = [t.data for t in unique if not is_tp_shard(t)]
    if topo.dp_size > 1 and rest:
        grads.broadcast_tensors(rest, topo.group("dp", state.rank)[0], process_group("dp"), topo.dp_size)
    if topo.rdp_size > 1 and shards:
        grads.broadcast_tensors(shards, topo.group("rdp", state.rank)[0], process_group("rdp"), topo.rdp_size)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
