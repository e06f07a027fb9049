"""fp16/bf16 training as SMP's ``fp16``/``bf16`` keys did it: a 16-bit model, fp32 master weights.

``smp.DistributedOptimizer`` returns ``FP16Optimizer`` when either key is on: the wrapped torch optimizer
(``optimizer.optimizer``, for LR schedulers) steps fp32 copies of this rank's parameters; ``step()`` copies
the 16-bit gradients in, unscales them, and skips the step on every pipeline stage if any stage
overflowed. fp16 scales the loss in ``model.backward`` (static or dynamic, SMP's dynamic-scaler rules);
bf16 does not scale. With ``shard_optimizer_state`` each rdp rank has masters for its share only, so the
overflow flag is agreed over the whole world (pipeline stages x tp x data-parallel shares), not only over
the model replica; ``clip_master_grads``' norm is in ``master_norm.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.errors import SMPConfigError
from smp_compat.globalstate import process_group, state
from smp_compat.precision.master_norm import global_norm
from smp_compat.precision.skipped_steps import SkipWatch

__all__ = ["LossScaler", "FP16Optimizer"]


_DYNAMIC_LOSS_ARGS = {"init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift",
                      "consecutive_hysteresis"}


@dataclass
class LossScaler:
    """Static, or dynamic with SMP's defaults: halve on overflow, double after ``scale_window`` clean steps.

    ``delayed_shift`` overflows in a row are needed to halve (hysteresis); the count is restored after
    ``scale_window`` clean steps (when the scale grows), or after any clean step with ``consecutive_hysteresis``
    (Megatron's ``DynamicLossScaler.update_scale``, which SMP's scaler follows).
    """

    scale: float = 1.0
    dynamic: bool = False
    scale_factor: float = 2.0
    scale_window: int = 1000
    min_scale: float = 1.0
    delayed_shift: int = 1
    consecutive_hysteresis: bool = False
    iteration: int = 0
    last_overflow: int = -1
    hysteresis: int = 1

    @classmethod
    def create(cls, static_loss_scale: float, dynamic: bool, args: dict[str, Any] | None) -> LossScaler:
        if not dynamic:
            return cls(scale=float(static_loss_scale))
        args = dict(args or {})
        unknown = sorted(set(args) - _DYNAMIC_LOSS_ARGS)
        if unknown:
            raise SMPConfigError(
                f"dynamic_loss_args has unknown key(s) {unknown}; SMP's keys are {sorted(_DYNAMIC_LOSS_ARGS)}."
            )
        scaler = cls(scale=float(args.pop("init_scale", 2.0**32)), dynamic=True, **args)
        scaler.hysteresis = scaler.delayed_shift
        return scaler

    def update(self, overflow: bool) -> None:
        if self.dynamic and overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        elif self.dynamic:
            if self.consecutive_hysteresis:
                self.hysteresis = self.delayed_shift
            if (self.iteration - self.last_overflow) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis = self.delayed_shift
                self.scale *= self.scale_factor
        self.iteration += 1


class FP16Optimizer:
    """SMP's FP16_Optimizer: fp32 master weights of the local 16-bit parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: Any, scaler: LossScaler, sharded: bool = False) -> None:
        self.optimizer = optimizer
        self.model = model
        self.loss_scaler = scaler
        self.overflow = False
        self._sharded = sharded
        self._skips = SkipWatch()
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._grads_ready = False
        model.after_partition(self._make_masters)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def _make_masters(self, model: Any) -> None:
        """fp32 copies of the local parameters replace them in the wrapped optimizer (not yet stepped)."""
        local = {id(p) for p in model.local_parameters()}
        for group in self.optimizer.param_groups:
            masters = []
            for p in group["params"]:
                if id(p) in local:
                    master = torch.nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                    self._pairs.append((p, master))
                    masters.append(master)
                    _move_state(self.optimizer.state, p, master)
            group["params"] = masters
        _drop_state_except(self.optimizer.state, {id(master) for _, master in self._pairs})

    def master_params(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(16-bit model parameter, fp32 master) pairs of this rank."""
        return list(self._pairs)

    def local_fp16_state_dict(self) -> dict[str, Any]:
        """Loss-scaler state and the fp32 masters by parameter name (SMP's ``fp16_states`` file)."""
        names = {id(p): n for n, p in self.model.local_named_parameters()}
        return {
            "loss_scaler": dataclasses.asdict(self.loss_scaler),
            "overflow": self.overflow,
            "fp32_master_params": {names[id(p)]: m.detach().clone() for p, m in self._pairs},
        }

    def load_local_fp16_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore scaler and masters exactly (16-bit weights alone would lose the masters' low bits)."""
        self.model.after_partition(lambda model: self._load_fp16(state_dict))

    def refresh_masters(self, params: list[torch.nn.Parameter]) -> None:
        """A model load after the masters were made: they take the loaded 16-bit values of ``params``, else
        the next ``step()`` would copy the old masters back over the load (an fp16_states load comes after)."""
        loaded = {id(p) for p in params}
        with torch.no_grad():
            for p, master in self._pairs:
                if id(p) in loaded:
                    master.copy_(p)

    def _load_fp16(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict["loss_scaler"].items():
            setattr(self.loss_scaler, key, value)
        self.overflow = bool(state_dict["overflow"])
        names = {id(p): n for n, p in self.model.local_named_parameters()}
        masters = state_dict["fp32_master_params"]
        with torch.no_grad():
            for p, master in self._pairs:
                saved = masters.get(names[id(p)])
                if saved is not None:
                    master.copy_(saved)
                    p.copy_(saved)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, master in self._pairs:
            for t in (p, master):
                if set_to_none:
                    t.grad = None
                elif t.grad is not None:
                    t.grad.zero_()
        self._grads_ready = False

    def _prepare_master_grads(self) -> None:
        """Copy the 16-bit gradients to the masters, unscaled, and agree on overflow with the other stages."""
        if self._grads_ready:
            return
        inv_scale = 1.0 / self.loss_scaler.scale
        found = torch.zeros((), dtype=torch.float32, device=state.device)
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
                continue
            master.grad = p.grad.detach().float().mul_(inv_scale)
            found += (~torch.isfinite(master.grad)).any().float()
        group = _agreement_group(self._sharded)
        if group is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        self.overflow = bool(found.item())
        self._grads_ready = True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the master gradients by their global norm (all stages, all shards); -1 on overflow."""
        self._prepare_master_grads()
        if self.overflow:
            return -1.0
        grads = [m.grad for _, m in self._pairs if m.grad is not None]
        total = global_norm(self._pairs, list(self.model.local_parameters()), norm_type, self._sharded)
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            for g in grads:
                g.mul_(coefficient)
        return total

    def step(self, closure: Any = None) -> Any:
        self._prepare_master_grads()
        self.loss_scaler.update(self.overflow)
        self._skips.record(self.overflow, self.loss_scaler.scale, self.loss_scaler.dynamic)
        self._grads_ready = False
        if self.overflow:
            return None
        result = self.optimizer.step(closure)
        with torch.no_grad():
            for p, master in self._pairs:
                p.copy_(master)
        return result


def _move_state(opt_state: Any, param: torch.nn.Parameter, master: torch.nn.Parameter) -> None:
    """State made before partitioning (Adagrad's, in ``__init__``) moves to the master, cast as torch's
    ``load_state_dict`` would (apex's FP16_Optimizer reloaded its state dict for this); left on the 16-bit
    parameter it would be neither stepped nor indexable by ``state_dict()``."""
    if param in opt_state:
        opt_state[master] = {key: _cast(key, value, master.dtype) for key, value in opt_state.pop(param).items()}


def _cast(key: str, value: Any, dtype: torch.dtype) -> Any:
    floating = torch.is_tensor(value) and value.is_floating_point()
    return value.to(dtype) if floating and key != "step" else value


def _drop_state_except(opt_state: Any, kept: set[int]) -> None:
    """Other stages' parameters leave the groups at partitioning: torch's ``state_dict()`` cannot index theirs."""
    for key in [key for key in opt_state if id(key) not in kept]:
        del opt_state[key]


def _agreement_group(sharded: bool) -> Any:
    """Who must agree on overflow: the model replica (mp), or everyone when data-parallel ranks hold shares."""
    if not state.initialized:
        return None
    if sharded and state.topology.dp_size > 1:
        return process_group("world")
    if state.topology.mp_size == 1:
        return None
    return process_group("mp")
