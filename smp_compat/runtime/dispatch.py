"""How a call to a placed module finds its owner: forwards that run locally or become remote calls.

``PipelineEngine`` swaps each placed module's ``forward`` for one of these when it partitions the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from smp_compat.errors import StepUsageError
from smp_compat.runtime.compiling import outside_compiled
from smp_compat.stepping.step import in_step, is_tracing

if TYPE_CHECKING:
    from smp_compat.runtime.engine import PipelineEngine

__all__ = ["call_children", "call_local", "dispatching_forward", "sequential_forward"]


def dispatching_forward(engine: PipelineEngine, index: int, owner: int, local: Callable[..., Any]) -> Callable[..., Any]:
    """A forward that runs locally on the owner (and while tracing), else as a remote call."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if owner == engine.pp_rank:
            return self._smp_local_forward(*args, **kwargs)  # looked up now: checkpointing may wrap it
        return _call_elsewhere(engine, self, index, owner, args, kwargs)

    engine.placement.modules[index]._smp_local_forward = local
    return forward


def call_local(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A served call of a module's own forward (compiled as a whole when the model is compiled)."""
    return module._smp_local_forward(*args, **kwargs)


def call_children(seq: nn.Sequential, start: int, stop: int, x: Any) -> Any:
    """A served run of Sequential children (compiled as a whole when the model is compiled)."""
    for child in list(seq)[start:stop]:
        x = child(x)
    return x


@outside_compiled
def _call_elsewhere(engine: PipelineEngine, module: nn.Module, index: int, owner: int, args: tuple, kwargs: dict) -> Any:
    """A module of another rank: a remote call (a graph break in compiled code), run here while tracing."""
    if is_tracing():
        return module._smp_local_forward(*args, **kwargs)
    if not in_step():
        raise StepUsageError(
            f"module {engine.placement.names[index]!r} lives on pipeline rank {owner}; with "
            "pipeline_parallel_degree > 1 it can only be called inside an @smp.step function."
        )
    return engine.remote_call(owner, ("module", index), args, kwargs)


def sequential_forward(engine: PipelineEngine, index: int) -> Callable[..., Any]:
    """nn.Sequential forward that sends each run of children living on one other rank as one request."""
    runs = engine.placement.sequential_runs(engine.placement.modules[index])

    def forward(self: nn.Module, x: Any) -> Any:
        children = list(self)
        for start, stop, rank in runs:
            if rank is None or rank == engine.pp_rank or not in_step() or is_tracing():
                for child in children[start:stop]:
                    x = child(x)
            else:
                x = _remote_run(engine, rank, ("seq", index, start, stop), x)
        return x

    return forward


@outside_compiled
def _remote_run(engine: PipelineEngine, rank: int, target: tuple[Any, ...], x: Any) -> Any:
    return engine.remote_call(rank, target, (x,), {})
