"""``torch.sagemaker.distributed.checkpoint.state_dict_utils``: SMP's per-rank state dicts and optimizer templates.

``SM_LOCAL_STATE_DICT`` is each rank's own shard of the model with no collective to build it. The
FSDP-backed model's sharded state dict already is that (DTensors holding this rank's shard; DCP writes
and reads only those pieces), so the context selects it; ``async_local`` then saves it over the rank's
replication group into a folder of its own. Other ``StateDictType`` values go to ``FSDP.state_dict_type``.
``_Interval`` and ``compute_auto_checkpoint_interval`` (HyperPod's automatic checkpoints) live in auto_interval.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType
from torch.distributed.tensor import DTensor

from smp_compat.v2.distributed.checkpoint.auto_interval import _Interval, compute_auto_checkpoint_interval

__all__ = ["SMStateDictType", "_Interval", "compute_auto_checkpoint_interval", "init_optim_state", "sm_state_dict_type"]


class SMStateDictType(Enum):
    """SMP's own state-dict type (beside FSDP's ``StateDictType``)."""

    SM_LOCAL_STATE_DICT = auto()


@contextmanager
def sm_state_dict_type(
    module: torch.nn.Module,
    state_dict_type: SMStateDictType | StateDictType,
    state_dict_config: Any = None,
    optim_state_dict_config: Any = None,
) -> Iterator[None]:
    """Within it, ``module.state_dict()`` is of ``state_dict_type``; SM_LOCAL is this rank's shard only.

    A model FSDP2 shards without the FSDP1 façade (``fully_shard`` called directly) has one kind of state
    dict, the sharded one, so SM_LOCAL leaves it as it is.
    """
    if state_dict_type is SMStateDictType.SM_LOCAL_STATE_DICT:
        state_dict_type, state_dict_config, optim_state_dict_config = StateDictType.SHARDED_STATE_DICT, None, None
        if not _fsdp1_api_serves(module):
            yield
            return
    with FSDP.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config):
        yield


def _fsdp1_api_serves(module: torch.nn.Module) -> bool:
    """Whether ``FSDP.state_dict_type`` applies to ``module``: FSDP1 modules, or the v2 façade's FSDP2 model."""
    from smp_compat.v2.fsdp import is_facade

    return bool(FSDP.fsdp_modules(module)) or any(is_facade(m) for m in module.modules())


def _local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


@torch.no_grad()
def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = False) -> None:
    """Create the optimizer's state (zeros) so a checkpoint can be loaded into it; parameters do not change.

    One step with zero gradients and every learning rate at 0 (AdamW's decay is then ``1 - 0 * wd``), then
    the learning rates and gradients are put back. ``skip_empty_param``: parameters whose local shard is
    empty get no state, as SMP leaves them. A no-op when the optimizer has state already.
    """
    if optimizer.state:
        return
    saved_grads, saved_lrs = [], []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            saved_grads.append(p.grad)
            keep = p.requires_grad and not (skip_empty_param and _local_numel(p) == 0)
            p.grad = torch.zeros_like(p) if keep else None
    try:
        optimizer.step()
    finally:
        grads = iter(saved_grads)
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
            for p in group["params"]:
                p.grad = next(grads)
