"""``smp.DistributedOptimizer``: SMP's optimizer patch (a function, not a class, as in SMP)."""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from smp_compat import sdp
from smp_compat.checkpoints import deferred_loads, optimizer_state, state_dicts
from smp_compat.errors import (
    CheckpointError,
    DistributedModelNotCreatedError,
    ParameterOwnershipError,
    SMPUnsupportedError,
)
from smp_compat.precision.fp16 import FP16Optimizer, LossScaler
from smp_compat.globalstate import state
from smp_compat.memory.optimizer_sharding import OptimizerSharding

__all__ = ["DistributedOptimizer"]

log = logging.getLogger("smp_compat")


def DistributedOptimizer(  # noqa: N802 - SMP's public name
    optimizer: torch.optim.Optimizer,
    static_loss_scale: float = 1.0,
    dynamic_loss_scale: bool = False,
    dynamic_loss_args: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Check the optimizer against the DistributedModel and return it, patched with SMP's extra methods."""
    state.require_init("smp.DistributedOptimizer")
    model = state.model
    if model is None:
        raise DistributedModelNotCreatedError(
            "smp.DistributedOptimizer was called before smp.DistributedModel. Wrap the model first, then "
            "create the optimizer from model.parameters() and wrap it."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"smp.DistributedOptimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    _check_ownership(optimizer, model)
    if not state.cfg.fp16 and (static_loss_scale != 1.0 or dynamic_loss_scale or dynamic_loss_args):
        log.debug("static_loss_scale/dynamic_loss_scale only apply when the config has fp16 on; ignored (as in SMP).")
    if sdp.enabled():
        from smp_compat.sdp.optimizer import ShardedOptimizer

        scaler = LossScaler.create(static_loss_scale, dynamic_loss_scale, dynamic_loss_args) if state.cfg.fp16 else None
        state.optimizer = ShardedOptimizer(optimizer, model, scaler)
        deferred_loads.attach_queued_optimizer_load(state.optimizer)  # type: ignore[arg-type]
        deferred_loads.attach_queued_fp16_load(state.optimizer)
        return state.optimizer  # type: ignore[return-value]
    _patch(optimizer)
    sharding = OptimizerSharding(optimizer) if state.cfg.shard_optimizer_state else None
    if sharding is not None:
        model.after_partition(sharding.apply)  # before the fp16 masters: masters only for this rank's share
    if state.cfg.fp16 or state.cfg.bf16:
        scaler = LossScaler.create(static_loss_scale, dynamic_loss_scale, dynamic_loss_args) if state.cfg.fp16 else LossScaler()
        optimizer = FP16Optimizer(optimizer, model, scaler, sharded=sharding is not None)  # type: ignore[assignment]
        deferred_loads.attach_queued_fp16_load(optimizer)  # after the queued optimizer load (in _patch)
    if sharding is not None:
        sharding.hook(optimizer)  # outermost: broadcast after the masters are copied into the 16-bit weights
    state.optimizer = optimizer
    return optimizer


def _check_ownership(optimizer: torch.optim.Optimizer, model: Any, start: int = 0) -> None:
    owned = {id(p) for p in model.module.parameters()}
    for gi, group in enumerate(optimizer.param_groups[start:], start):
        for p in group["params"]:
            if id(p) not in owned:
                raise ParameterOwnershipError(
                    f"param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that is not part of the "
                    "DistributedModel. Create the optimizer from model.parameters() after wrapping the model."
                )


def _patch_add_param_group(optimizer: torch.optim.Optimizer) -> None:
    """A group added after wrapping joins the record of the user's groups (state dicts, loads), checked as
    the groups at wrapping were. After partitioning, fp16/bf16 masters and optimizer-state shares are already
    made for the groups then present, so a later group there would train wrong: refused."""
    original_add = optimizer.add_param_group

    def add_param_group(_: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        model = state.model
        if model is None:  # after smp.reset(): nothing to record against
            return original_add(param_group)
        if model.partitioned:
            _refuse_late_group()
        original_add(param_group)
        try:
            _check_ownership(optimizer, model, start=len(optimizer.param_groups) - 1)
        except ParameterOwnershipError:
            optimizer.param_groups.pop()
            raise
        optimizer_state.record_added_group(optimizer, optimizer.param_groups[-1]["params"])

    optimizer.add_param_group = types.MethodType(add_param_group, optimizer)  # type: ignore[method-assign]


def _refuse_late_group() -> None:
    """fp16/bf16 masters and optimizer-state shares exist only for the groups present at partitioning."""
    features = [k for k in ("fp16", "bf16", "shard_optimizer_state") if getattr(state.cfg, k)]
    if features:
        raise SMPUnsupportedError(
            f"optimizer.add_param_group() after the model was partitioned (the first smp.step call) with "
            f"{' and '.join(features)}; add the group before the first smp.step call"
        )


def _reduce_before_step(optimizer: torch.optim.Optimizer) -> None:
    """A tensor-parallel model trained with plain loss.backward() at pp = 1 (SMP allowed it) gets its
    gradients reduced here, right before the update."""
    original_step = optimizer.step

    def step(_: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if state.model is not None:
            state.model.reduce_plain_gradients()
        return original_step(*args, **kwargs)

    # a bound method, as torch's LR schedulers expect when they wrap optimizer.step (they rebind its __func__)
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def _patch(optimizer: torch.optim.Optimizer) -> None:
    """Add SMP's state-dict methods (full, local, deferred load); the logic lives in checkpoints/optimizer_state.py."""
    original_state_dict = optimizer.state_dict
    original_load = optimizer.load_state_dict
    optimizer_state.record_param_order(optimizer)

    def state_dict(gather_to_rank0: bool = False, cast_to_cpu: bool = True) -> dict[str, Any]:
        """Plain torch format over every parameter; collective over the pipeline group once partitioned."""
        return optimizer_state.optimizer_state_dict(optimizer, original_state_dict, gather_to_rank0, cast_to_cpu)

    def local_state_dict(gather_if_shard: bool = False, **_: Any) -> dict[str, Any]:
        """This rank's parameters' state, marked ``_smp_is_partial``, with parameter names. With
        ``shard_optimizer_state``, ``gather_if_shard=True`` adds the other rdp ranks' shares, for a script that
        saves from rdp_rank 0 only: a collective over the rdp group, so every rank calls it."""
        return optimizer_state.optimizer_local_state_dict(optimizer, original_state_dict, gather_if_shard)

    def load_state_dict(state_dict: dict[str, Any], gather_if_shard: bool = True) -> None:
        """Full or partial dict; applied once the model is partitioned. ``gather_if_shard`` is SMP's second
        argument (AWS's 2021-22 GPT-2 script passes it): each rank takes its own share's state by parameter
        name, from a gathered dict or from its own share's."""
        del gather_if_shard
        optimizer_state.load_optimizer_state(optimizer, state_dict, original_load)

    def load_local_optimizer_state_dict(state_dict: dict[str, Any]) -> None:
        """SMP >= 1.10: like load_state_dict, for partial dicts only."""
        if not state_dicts.is_partial(state_dict):
            raise CheckpointError(
                "load_local_optimizer_state_dict() takes a partial dict (from optimizer.local_state_dict(), marked "
                "_smp_is_partial); this one is full. Use optimizer.load_state_dict() for full dicts."
            )
        load_state_dict(state_dict)

    _reduce_before_step(optimizer)
    _patch_add_param_group(optimizer)
    optimizer.state_dict = state_dict  # type: ignore[method-assign]
    optimizer.local_state_dict = local_state_dict  # type: ignore[attr-defined]
    optimizer.local_optimizer_state_dict = local_state_dict  # type: ignore[attr-defined]
    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]
    optimizer.load_local_optimizer_state_dict = load_local_optimizer_state_dict  # type: ignore[attr-defined]
    deferred_loads.attach_queued_optimizer_load(optimizer)
