"""Train a recipe twice, in one process on the global batch and under smp, and measure how far apart they end.

The one-process run is plain PyTorch on this rank's device: the oracle every check is held against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from smp_compat.selftest.faults import Injector
from smp_compat.selftest.models import Recipe

__all__ = ["Measured", "Tolerance", "Tracker", "compared_params", "reference_run", "smp_run"]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol + rtol * |expected|``, element by element (torch.allclose's rule)."""

    rtol: float
    atol: float


@dataclass(frozen=True)
class Measured:
    """What a check found on this rank: the largest difference, the first value outside the tolerance, and when
    this rank first diverged (step k's loss at k - 0.5, the parameters after step k at k), so that the rank
    where a run went wrong first is told apart from the ranks it then spoiled."""

    worst: float
    problem: str | None = None
    diverged_at: float | None = None


class Tracker:
    """Holds each step's loss and this rank's parameters against the one-process run's, step by step."""

    def __init__(self, reference: tuple[list[float], list[dict[str, torch.Tensor]]], tol: Tolerance) -> None:
        self.losses, self.states = reference
        self.tol = tol
        self.worst = 0.0
        self.problem: str | None = None
        self.diverged_at: float | None = None
        self.steps_seen = 0

    def step(self, index: int, loss: float, params: Mapping[str, torch.Tensor] | None) -> None:
        """After step ``index`` (from 0): its loss, and the parameters it left (None: none to compare here)."""
        self.steps_seen += 1
        self._pair(index + 0.5, f"the loss of step {index + 1}", torch.tensor(loss), torch.tensor(self.losses[index]))
        if params is None:
            return
        if not params:
            self._fail(index + 1.0, "this rank holds no parameters to compare")
        expected = self.states[index]
        for name, value in params.items():
            if name not in expected:
                self._fail(index + 1.0, f"parameter {name!r} is not in the one-process model's state dict")
            else:
                self._pair(index + 1.0, f"parameter {name!r} after step {index + 1}", value, expected[name])

    def _pair(self, at: float, name: str, actual: torch.Tensor, wanted: torch.Tensor) -> None:
        if actual.shape != wanted.shape:
            self._fail(at, f"{name} has shape {tuple(actual.shape)}, expected {tuple(wanted.shape)}")
            return
        diff = (actual.float() - wanted.float()).abs()
        biggest = float(diff.max()) if diff.numel() else 0.0
        self.worst = max(self.worst, biggest) if biggest == biggest else float("inf")  # NaN: infinitely far
        if not torch.allclose(actual.float(), wanted.float(), rtol=self.tol.rtol, atol=self.tol.atol):
            self._fail(at, f"{name} differs by {biggest:.3g}")

    def _fail(self, at: float, problem: str) -> None:
        if self.problem is None:
            self.problem, self.diverged_at = problem, at

    def result(self) -> Measured:
        if self.problem is None and self.steps_seen < len(self.losses):
            self._fail(float(self.steps_seen), f"{self.steps_seen} steps ran, expected {len(self.losses)}")
        return Measured(self.worst, self.problem, self.diverged_at)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """torch's autocast to ``dtype`` on ``device`` (no-op when None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def reference_run(recipe: Recipe, global_batch: int, device: torch.device,
                  cast: torch.dtype | None = None) -> tuple[list[float], list[dict[str, torch.Tensor]]]:  # fmt: skip
    """Plain PyTorch in this process on the whole global batch: each step's loss and the state it left."""
    torch.manual_seed(0)
    model = recipe.build().to(device)
    opt = recipe.optimizer(model.parameters())
    losses, states = [], []
    for batch in recipe.batches(global_batch)[: recipe.steps]:
        opt.zero_grad()
        with autocast(device, cast):
            loss = recipe.loss(model, *(t.to(device) for t in batch))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        states.append({k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()})
    return losses, states


def my_samples(smp: Any, t: torch.Tensor) -> torch.Tensor:
    """This rank's share of a global batch: by dp rank, or by rdp rank with ``prescaled_batch`` (as SMP)."""
    if smp.state.cfg.prescaled_batch and smp.tp_size() > 1:
        index, count = smp.rdp_rank(), smp.rdp_size()
    else:
        index, count = smp.dp_rank(), smp.dp_size()
    per = t.shape[0] // count
    return t[index * per : (index + 1) * per]


def smp_run(smp: Any, recipe: Recipe, model: Any, opt: Any, global_batch: int, injector: Injector,
            observe: Callable[[int, float], None], steps: range | None = None, cast: torch.dtype | None = None,
            scaler: Any = None) -> None:  # fmt: skip
    """The SMP-style loop: ``@smp.step`` with ``model.backward`` on this rank's samples; ``observe(step, loss)``
    after each step, with the global mean loss."""
    device = smp.state.device

    @smp.step
    def train_step(model: Any, *batch: torch.Tensor) -> torch.Tensor:
        with autocast(device, cast):
            loss = recipe.loss(model, *batch)
        model.backward(scaler.scale(loss) if scaler is not None else loss)
        return loss

    data = recipe.batches(global_batch)
    for index in steps if steps is not None else range(recipe.steps):
        opt.zero_grad()
        with injector.messages():
            out = train_step(model, *(my_samples(smp, t).to(device) for t in data[index]))
        injector.after_backward(model, index)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        mine = out.reduce_mean().item()
        observe(index, sum(smp.allgather(mine, smp.DP_GROUP)) / smp.dp_size())


def compared_params(smp: Any, model: Any, whole: bool,
                    rename: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                    ) -> dict[str, torch.Tensor] | None:  # fmt: skip
    """What this rank holds: its own stage's parameters and buffers, so a difference names the rank that holds it.

    ``whole``: the gathered state dict (tensor-parallel shards and sharded data parallelism split parameters
    across ranks); gathering is a collective, so every rank calls it, and with pp > 1 only the first stage
    has it whole (None elsewhere)."""
    if whole:
        state = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        if smp.pp_size() > 1 and smp.pp_rank() != 0:
            return None
    else:
        state = {n: t.detach() for n, t in [*model.local_named_parameters(), *model.local_named_buffers()]}
    if rename is not None:
        state = rename(state)
    return {k: v.float().cpu() for k, v in state.items()}
