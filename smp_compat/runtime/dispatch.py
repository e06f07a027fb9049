"""How a call to a placed module finds its owner: forwards that run locally or become remote calls.

``PipelineEngine`` swaps each placed module's ``forward`` for one of these when it partitions the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from smp_compat.errors import StepUsageError
from smp_compat.stepping.step import in_step, is_tracing

if TYPE_CHECKING:
    from smp_compat.runtime.engine import PipelineEngine

__all__ = ["dispatching_forward", "sequential_forward"]


def dispatching_forward(engine: PipelineEngine, index: int, owner: int, local: Callable[..., Any]) -> Callable[..., Any]:
    """A forward that runs locally on the owner (and while tracing), else as a remote call."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if owner == engine.pp_rank or is_tracing():
            return self._smp_local_forward(*args, **kwargs)  # looked up now: checkpointing may wrap it
        if not in_step():
            raise StepUsageError(
                f"module {engine.placement.names[index]!r} lives on pipeline rank {owner}; with "
                "pipeline_parallel_degree > 1 it can only be called inside an @smp.step function."
            )
        return engine.remote_call(owner, ("module", index), args, kwargs)

    engine.placement.modules[index]._smp_local_forward = local
    return forward


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
                x = engine.remote_call(rank, ("seq", index, start, stop), (x,), {})
        return x

    return forward
