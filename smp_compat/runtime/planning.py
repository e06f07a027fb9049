"""The partition plan of the first step: traced or manual on global rank 0, broadcast to every rank."""

from __future__ import annotations

import io
import logging
from typing import Any

from rich.console import Console
from torch import nn

from smp_compat import failure
from smp_compat.memory.model_creation import is_delayed
from smp_compat.errors import StepUsageError
from smp_compat.globalstate import state
from smp_compat.partitioning import PartitionPlan, TraceResult, auto_plan, manual_plan, trace_modules, validate_plan
from smp_compat.comm import broadcast_object
from smp_compat.stepping.step import tracing_call
from smp_compat.partitioning.trace import TIMING_RUNS

__all__ = ["decide_plan", "render_plan"]

log = logging.getLogger("smp_compat")


def decide_plan(model: Any, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> PartitionPlan:
    """Global rank 0 traces (auto) or reads the manual assignment, then every rank gets the same plan.

    Under tensor parallelism rank 0's tp peers trace with it (their results are dropped): the traced
    forward runs the distributed layers' collectives, which need every member of the tp group. When rank 0
    fails (the traced step body raises), every rank raises its error: the step failed everywhere, and the
    next step plans again.
    """
    tracing = state.cfg.auto_partition and not is_delayed(model.module)
    decided: tuple[str, Any] | None = None
    error: BaseException | None = None
    if state.rank == 0 or (tracing and state.rank in state.topology.group("tp", 0)):
        try:
            plan = _plan_here(model, step_fn, microbatches)
            decided = ("plan", plan.to_dict())
        except Exception as exc:  # noqa: BLE001 - every rank raises it (the traced step body, or a bad plan)
            error, decided = exc, ("error", failure.portable(exc))
    kind, value = broadcast_object(decided if state.rank == 0 else None, src=0)
    if kind == "error" and state.rank != 0:
        failure.raised_elsewhere(value, 0, state.rank)
        raise value
    if error is not None:
        raise error
    return PartitionPlan.from_dict(value)


def _plan_here(model: Any, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> PartitionPlan:
    cfg = state.cfg
    root = model.module
    if cfg.auto_partition and is_delayed(root):
        log.info("parameters are not materialized yet (delayed initialization): partitioning without a trace")
        plan = auto_plan(root, TraceResult(), cfg.pipeline_parallel_degree, cfg.memory_weight)
    elif cfg.auto_partition:
        plan = auto_plan(root, _trace(model, step_fn, microbatches), cfg.pipeline_parallel_degree, cfg.memory_weight)
    else:
        plan = manual_plan(root, cfg.pipeline_parallel_degree, cfg.default_partition)
    validate_plan(root, plan)
    return plan


def _trace(model: Any, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> TraceResult:
    """Microbatch 0 of the first step, traced (module order, output sizes, optionally times)."""
    if not microbatches:
        raise StepUsageError("automatic partitioning needs the step inputs on rank 0")
    args, kwargs = microbatches[0]
    with tracing_call(len(microbatches)) as call:
        return trace_modules(
            model.module,
            lambda: step_fn.run_microbatch(0, args, kwargs, call),
            measure_time=model.trace_execution_times,
            timing_runs=TIMING_RUNS,
        )


def render_plan(plan: PartitionPlan, root: nn.Module) -> str:
    console = Console(width=120, file=io.StringIO())
    console.print(plan.render(root))
    return console.file.getvalue()
