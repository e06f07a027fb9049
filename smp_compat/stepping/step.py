"""``@smp.step``: run a function once per microbatch and collect ``StepOutput``s.

The body runs on pp_rank 0 of each pipeline group; with pp > 1 the pipeline engine runs the
microbatches concurrently and the other stages serve module calls. When a step call returns,
backward and the data-parallel gradient all-reduce are complete (SMP's contract).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from smp_compat.errors import StepUsageError
from smp_compat.stepping.signature import validate_split_options
from smp_compat.stepping.split import split_step_inputs
from smp_compat.globalstate import state
from smp_compat.stepping.output import merge_step_outputs

__all__ = [
    "step", "StepFunction", "StepCall", "in_step", "current_microbatch", "set_current_microbatch",
    "is_tracing", "tracing_call", "active_call",
]  # fmt: skip

_local = threading.local()


@dataclass
class StepCall:
    """What every microbatch of the step call in progress shares."""

    num_microbatches: int
    grad_enabled: bool
    tracing: bool = False


_active: list[StepCall] = []


def in_step() -> bool:
    """True while an ``@smp.step`` function is running on this process."""
    return bool(_active)


def active_call() -> StepCall | None:
    return _active[-1] if _active else None


def current_microbatch() -> int | None:
    """Index of the microbatch the calling thread is running, or None outside a step."""
    return getattr(_local, "microbatch", None)


def set_current_microbatch(mb: int | None) -> None:
    _local.microbatch = mb


def is_tracing() -> bool:
    """True during the one-off tracing pass of the first step (rank 0 only)."""
    call = active_call()
    return bool(call and call.tracing)


@contextlib.contextmanager
def tracing_call(num_microbatches: int) -> Iterator[StepCall]:
    """The one-off tracing pass of the first step: model.backward does nothing, is_tracing() is True."""
    call = StepCall(num_microbatches=num_microbatches, grad_enabled=False, tracing=True)
    _active.append(call)
    try:
        yield call
    finally:
        _active.pop()


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # the usual output (a loss): no tree walk per microbatch
        return value.detach()
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


class StepFunction:
    """The callable ``@smp.step`` returns."""

    def __init__(
        self,
        func: Callable[..., Any],
        non_split_inputs: Sequence[str] | None,
        input_split_axes: Mapping[str, int] | None,
        detach_outputs: bool,
    ) -> None:
        validate_split_options(func, non_split_inputs, input_split_axes)
        self.func = func
        self.non_split_inputs = list(non_split_inputs or [])
        self.input_split_axes = dict(input_split_axes or {})
        self.detach_outputs = detach_outputs
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state.require_init("@smp.step")
        if in_step():
            raise StepUsageError(
                f"@smp.step function {self.func.__name__!r} was called from inside another step function. "
                "Call step functions one after the other from your training loop."
            )
        num_mb = state.cfg.microbatches
        model = state.model
        runs_body = model is None or model.runs_step_body()
        microbatches = self.split(args, kwargs, num_mb) if runs_body else []
        if model is not None:
            model._prepare_for_step(self, microbatches)
        call = StepCall(num_microbatches=num_mb, grad_enabled=torch.is_grad_enabled())
        _active.append(call)
        try:
            if model is not None and model.pipeline_engine is not None:
                outputs = model.pipeline_engine.run_step(self, call, microbatches)
            else:
                outputs = [self.run_microbatch(mb, a, kw, call) for mb, (a, kw) in enumerate(microbatches)]
        finally:
            _active.pop()
        if model is not None:
            model._finish_step()
        return merge_step_outputs(outputs)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """``@smp.step`` on a method (``def train_step(self, model, x)``) binds like a plain function."""
        if instance is None:
            return self
        return functools.partial(self, instance)

    def split(self, args: tuple[Any, ...], kwargs: dict[str, Any], num_mb: int) -> list[tuple[tuple, dict]]:
        return split_step_inputs(self.func, args, kwargs, num_mb, self.non_split_inputs, self.input_split_axes)

    def run_microbatch(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any], call: StepCall) -> Any:
        """Run the body for one microbatch with the grad mode the step was called under."""
        set_current_microbatch(mb)
        try:
            with torch.set_grad_enabled(call.grad_enabled):
                out = self.func(*args, **kwargs)
        finally:
            set_current_microbatch(None)
        return _detach(out) if self.detach_outputs else out


def step(
    func: Callable[..., Any] | None = None,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
    detach_outputs: bool = True,
) -> Any:
    """Decorator: ``@smp.step``, ``@smp.step()`` or ``@smp.step(non_split_inputs=[...], ...)``."""

    def wrap(f: Callable[..., Any]) -> StepFunction:
        return StepFunction(f, non_split_inputs, input_split_axes, detach_outputs)

    if func is None:
        return wrap
    if not callable(func):
        raise StepUsageError(
            f"@smp.step expects a function, got {type(func).__name__}. Use @smp.step or "
            "@smp.step(non_split_inputs=[...], input_split_axes={...})."
        )
    return wrap(func)
