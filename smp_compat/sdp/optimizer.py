"""The optimizer ``smp.DistributedOptimizer`` returns under sharded data parallelism.

As in SMP, it wraps the torch optimizer (``optimizer.optimizer``, for LR schedulers) and clips inside
``step()``: the global gradient norm (over all shards) is clipped to ``sdp_gradient_clipping`` and kept
as ``optimizer._global_grad_norm``. The parameters are FSDP2's fp32 shards, so they are the fp32 master
weights; with ``fp16`` the loss is scaled in ``model.backward`` and ``step()`` unscales, skips the step
on every rank when any rank overflowed, and updates the scale (SMP's dynamic-scaler rules).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from smp_compat.errors import SMPUnsupportedError
from smp_compat.precision.fp16 import LossScaler
from smp_compat.globalstate import process_group, state
from smp_compat.sdp import state_dicts as sdp_state
from smp_compat.sdp import tp
from smp_compat.sdp.mesh import shard_dim_mesh
from smp_compat.sdp.norms import clip_by_norm, global_grad_norm

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer:
    """SMP's sharded-DP optimizer wrapper over any torch optimizer built from ``model.parameters()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: Any, scaler: LossScaler | None) -> None:
        self.optimizer = optimizer
        self.model = model
        self.loss_scaler = scaler
        self.overflow = False
        self._norm: torch.Tensor | float | None = None  # a tensor until read: no host sync in step()
        self._unscaled = False

    @property
    def _global_grad_norm(self) -> float | None:
        """The global gradient norm before clipping in the last ``step()`` (-1.0 if it was skipped), as SMP."""
        if isinstance(self._norm, torch.Tensor):
            self._norm = float(self._norm)
        return self._norm

    # ------------------------------------------------------------------ torch optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without fp16: no scaling)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else None

    def __getattr__(self, name: str) -> Any:
        if name == "fp16_partitioned_groups_flat":
            raise SMPUnsupportedError(
                "optimizer.fp16_partitioned_groups_flat (DeepSpeed's flat 16-bit partitions): FSDP2 keeps none. "
                "Read each parameter's local shard with p.to_local() (or p.ds_tensor), or the sharded state with "
                "model.local_state_dict()."
            )
        return getattr(self.optimizer, name)

    def add_param_group(self, group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._unscaled = False

    # ------------------------------------------------------------------ clipping and stepping
    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _unscale(self) -> None:
        """fp16: divide the gradients by the loss scale once and agree on overflow over the whole job."""
        if self._unscaled:
            return
        self._unscaled = True
        if self.loss_scaler is None:
            self.overflow = False
            return
        inv = 1.0 / self.loss_scaler.scale
        found = torch.zeros((), dtype=torch.float32, device=state.device)
        with torch.no_grad():
            for g in self._grads():
                local = g.to_local() if isinstance(g, DTensor) else g
                local.mul_(inv)
                found += (~torch.isfinite(local)).any().float()
        if state.world_size > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self.overflow = bool(found.item())

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the (unscaled) gradients to ``max_norm`` by their global norm and return it; -1 on overflow."""
        self._reduce_plain_backward()
        self._unscale()
        if self.overflow:
            return -1.0
        grads = self._grads()
        total = self._global_norm(norm_type)
        clip_by_norm(grads, max_norm, total)
        return float(total)

    def _global_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global norm; under tensor parallelism the tp shards' pieces are summed over the tp group."""
        if tp.tp_size() == 1:
            return global_grad_norm(self._grads(), norm_type)
        replicated, shards = tp.split_tp(p for g in self.optimizer.param_groups for p in g["params"])
        return global_grad_norm(replicated, norm_type, shards, process_group("tp"))

    def _reduce_plain_backward(self) -> None:
        """tp > 1 without @smp.step (SMP allowed it at pp = 1): the tp part of the gradient rule, once."""
        if getattr(self.model, "_plain_forward", False) and tp.tp_size() > 1:
            self.model._plain_forward = False
            tp.reduce_tp_gradients(self.model.module.parameters())

    def step(self, closure: Any = None) -> Any:
        """Unscale, clip to ``sdp_gradient_clipping`` (0 turns it off), then step; skipped on fp16 overflow."""
        self._reduce_plain_backward()
        self._unscale()
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.overflow)
        self._unscaled = False
        if self.overflow:
            self._norm = -1.0
            return None
        clip = state.cfg.sdp_gradient_clipping
        grads = self._grads()
        total = self._global_norm()
        if clip > 0:
            clip_by_norm(grads, clip, total)
        self._norm = total
        return self.optimizer.step(closure)

    # ------------------------------------------------------------------ state dicts
    def state_dict(self, gather_to_rank0: bool = False, cast_to_cpu: bool = True, **_: Any) -> dict[str, Any]:
        """The full optimizer state keyed by parameter names (collective over the job; every rank gets it)."""
        return sdp_state.full_optimizer_state_dict(self.model, self.optimizer, cast_to_cpu)

    def local_state_dict(self, **_: Any) -> dict[str, Any]:
        """This rank's shards of the optimizer state (torch DCP's sharded form, keyed by parameter names)."""
        return sdp_state.sharded_optimizer_state_dict(self.model, self.optimizer)

    local_optimizer_state_dict = local_state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A full (from ``state_dict()``) or sharded (from ``local_state_dict()``, same sdp) state."""
        sdp_state.load_optimizer_state_dict(self.model, self.optimizer, state_dict)

    load_local_optimizer_state_dict = load_state_dict

    def local_fp16_state_dict(self) -> dict[str, Any]:
        """The loss-scaler state (the masters are the sharded parameters themselves)."""
        scaler = dataclasses.asdict(self.loss_scaler) if self.loss_scaler is not None else None
        return {"loss_scaler": scaler, "overflow": self.overflow}

    def load_local_fp16_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scaler is not None and state_dict.get("loss_scaler"):
            for key, value in state_dict["loss_scaler"].items():
                setattr(self.loss_scaler, key, value)
        self.overflow = bool(state_dict.get("overflow", False))

    # ------------------------------------------------------------------ DeepSpeed-shaped views (read by AWS scripts)
    @property
    def fp16_groups(self) -> list[list[torch.nn.Parameter]]:
        """The model parameters of each param group, as DeepSpeed's ZeRO-3 optimizer listed them."""
        return [list(g["params"]) for g in self.optimizer.param_groups]

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """Per param group, this rank's fp32 shards concatenated in group order (a read-only snapshot).

        AWS's ``sdp_utils.build_param_id_to_buffer`` narrows it at offsets summed from ``p.ds_tensor.ds_numel``
        to log parameter norms; the same offsets work here. Unlike DeepSpeed's buffer it is a copy: writing
        into it does not change the parameters (FSDP2 keeps no flat buffer).
        """
        flats = []
        for g in self.optimizer.param_groups:
            pieces = [(p.to_local() if isinstance(p, DTensor) else p).detach().float().reshape(-1) for p in g["params"]]
            flats.append(torch.cat(pieces) if pieces else torch.zeros(0, device=state.device))
        return flats

    @property
    def ds_param_shard_group(self) -> Any:
        """The process group of this rank's sharding group."""
        return shard_dim_mesh().get_group()
