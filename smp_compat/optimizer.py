"""``smp.DistributedOptimizer``: SMP's optimizer patch (a function, not a class, as in SMP)."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from smp_compat.errors import DistributedModelNotCreatedError, ParameterOwnershipError, SMPUnsupportedError
from smp_compat.globalstate import state
from smp_compat.sharding import OptimizerSharding

__all__ = ["DistributedOptimizer"]


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
    if state.cfg.fp16 or state.cfg.bf16:
        raise SMPUnsupportedError("fp16/bf16 optimizer wrapping with master weights (issue #6)")
    if static_loss_scale != 1.0 or dynamic_loss_scale or dynamic_loss_args:
        warnings.warn(
            "static_loss_scale/dynamic_loss_scale only apply when the config has fp16 on; ignored.", stacklevel=2
        )
    _patch(optimizer)
    if state.cfg.shard_optimizer_state:
        model.after_partition(OptimizerSharding(optimizer).apply)
    state.optimizer = optimizer
    return optimizer


def _check_ownership(optimizer: torch.optim.Optimizer, model: Any) -> None:
    owned = {id(p) for p in model.module.parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in owned:
                raise ParameterOwnershipError(
                    f"param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that is not part of the "
                    "DistributedModel. Create the optimizer from model.parameters() after wrapping the model."
                )


def _patch(optimizer: torch.optim.Optimizer) -> None:
    """Add SMP's state-dict methods; the full/partial forms are the same until pipeline checkpoints land."""

    def local_state_dict() -> dict[str, Any]:
        sd = OrderedDict(optimizer.state_dict())
        sd["_smp_is_partial"] = True
        return sd

    original_load = optimizer.load_state_dict

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        clean = {k: v for k, v in state_dict.items() if k != "_smp_is_partial"}
        original_load(clean)

    optimizer.local_state_dict = local_state_dict  # type: ignore[attr-defined]
    optimizer.load_state_dict = load_state_dict  # type: ignore[method-assign]
