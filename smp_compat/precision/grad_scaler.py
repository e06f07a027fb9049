"""``smp.amp.GradScaler``: torch's loss scaler, with the skip-or-step decision agreed by the whole pipeline.

Each pipeline stage sees only its own gradients, so one stage may overflow while another does not. SMP's
scaler all-reduced the found-inf flag over the model-parallel group so every stage skips or steps
together, and did not crash on a stage without local parameters; so does this one. A stage that never
ran ``scaler.scale(loss)`` (only pp_rank 0 runs the step body) starts from the same initial scale.
With ``shard_optimizer_state`` each data-parallel rank's optimizer holds only its share, so the flag is
agreed over the whole world: otherwise the rank whose share overflowed would skip while the others step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from smp_compat.globalstate import process_group, state

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """Drop-in for ``torch.cuda.amp.GradScaler`` in SMP scripts (same arguments, any device)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        device: str | None = None,
    ) -> None:
        super().__init__(device or _device_type(), init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def _ensure_scale(self) -> None:
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(_device())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._ensure_scale()
        return super().step(optimizer, *args, **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._ensure_scale()
        super().unscale_(optimizer)
        if self._enabled:
            self._agree_on_overflow(optimizer)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._ensure_scale()
        super().update(new_scale)

    def _agree_on_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        """One found-inf flag for all stages: any stage's overflow makes every stage skip this step."""
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)  # type: ignore[union-attr]
        for flag in optimizer_state["found_inf_per_device"].values():
            found += flag.to(found.device)
        group = _agreement_group()
        if group is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        optimizer_state["found_inf_per_device"] = {found.device: found}


def _agreement_group() -> Any:
    """The pipeline; everyone when data-parallel ranks hold optimizer shares."""
    if not state.initialized:
        return None
    if state.cfg.shard_optimizer_state and state.topology.dp_size > 1:
        return process_group("world")
    if state.topology.mp_size == 1:
        return None
    return process_group("mp")


def _device() -> torch.device:
    return state.device if state.initialized else torch.device(_device_type())


def _device_type() -> str:
    if state.initialized:
        return state.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"
