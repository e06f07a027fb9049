"""``smp-compat plan``: show the partition smp_compat would choose for a model, in one process, before a run.

It imports a model factory (``package.module:function`` or ``path/to/file.py:function``), builds the model
under the given config (so ``smp.partition`` blocks record as they would after ``smp.init``), traces one
forward pass of microbatch 0 of sample inputs, and runs the same planner as the first ``@smp.step``:
``auto_plan`` (or ``manual_plan`` with ``auto_partition: false``). No process group is created.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from smp_compat import shim
from smp_compat.cli.launch_config import read_launch_config
from smp_compat.config import SMPConfig, resolve_config
from smp_compat.errors import SMPConfigError
from smp_compat.globalstate import state
from smp_compat.partitioning import PartitionPlan, auto_plan, clear_records, manual_plan, trace_modules, validate_plan
from smp_compat.partitioning.plan import human_bytes
from smp_compat.partitioning.trace import TIMING_RUNS, TraceResult
from smp_compat.topology import Topology

__all__ = [
    "InputSpec",
    "PlanResult",
    "RankSummary",
    "load_factory",
    "make_inputs",
    "parse_inputs",
    "plan_command",
    "plan_model",
    "rank_summaries",
]

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool,
}  # fmt: skip
_DEFAULT_INT_HIGH = 2


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputSpec:
    """One positional input of the model: its shape for a whole step batch, dtype, and (ints) value bound."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    high: int | None = None


def _parse_one(text: str) -> InputSpec:
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 3 or not parts[0]:
        raise SMPConfigError(
            f"Cannot read the input spec {text!r}: write SHAPE[:DTYPE[:HIGH]], e.g. 8x1x28x28:float32 or "
            "8x16:int64:50257 (integers drawn from [0, HIGH)); separate inputs with commas."
        )
    try:
        shape = tuple(int(d) for d in parts[0].lower().split("x"))
    except ValueError:
        raise SMPConfigError(
            f"The shape {parts[0]!r} in input spec {text!r} is not dimensions joined by 'x' (e.g. 8x16)."
        ) from None
    if any(d < 1 for d in shape):
        raise SMPConfigError(f"The shape {parts[0]!r} in input spec {text!r} has a dimension below 1.")
    name = parts[1].lower() if len(parts) > 1 and parts[1] else "float32"
    if name not in _DTYPES:
        raise SMPConfigError(f"Unknown dtype {name!r} in input spec {text!r}; use one of {', '.join(_DTYPES)}.")
    high = None
    if len(parts) == 3:
        if not parts[2].isdigit() or int(parts[2]) < 1:
            raise SMPConfigError(f"HIGH in input spec {text!r} must be a positive integer, got {parts[2]!r}.")
        high = int(parts[2])
    return InputSpec(shape, _DTYPES[name], high)


def parse_inputs(text: str) -> list[InputSpec]:
    """``"8x16:int64:100,8x16:float32"`` -> one spec per positional model input."""
    return [_parse_one(part) for part in text.split(",") if part.strip()]


def make_inputs(specs: Sequence[InputSpec], microbatches: int, seed: int = 0) -> list[torch.Tensor]:
    """Random tensors for microbatch 0: each batch dimension (dim 0) divided by ``microbatches``, as smp.step splits."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for index, spec in enumerate(specs):
        batch = spec.shape[0]
        if len(spec.shape) == 0 or batch % microbatches:
            raise SMPConfigError(
                f"Input {index} has batch dimension {batch}, which does not split into microbatches={microbatches}; "
                "give the batch of one step call (a multiple of microbatches)."
            )
        shape = (batch // microbatches, *spec.shape[1:])
        if spec.dtype.is_floating_point:
            tensors.append(torch.randn(shape, generator=generator).to(spec.dtype))
        elif spec.dtype == torch.bool:
            tensors.append(torch.randint(0, 2, shape, generator=generator).bool())
        else:
            high = spec.high or _DEFAULT_INT_HIGH
            tensors.append(torch.randint(0, high, shape, generator=generator, dtype=spec.dtype))
    return tensors


# ---------------------------------------------------------------- the factory


def _import_module(target: str) -> Any:
    """A module by dotted name (the current directory on the path) or by file path."""
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise SMPConfigError(f"The model factory file {target!r} does not exist (relative to {Path.cwd()}).")
        spec = importlib.util.spec_from_file_location(f"_smp_plan_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise SMPConfigError(f"Cannot import {target!r} as a Python file.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise SMPConfigError(
            f"Cannot import the module {target!r}: {exc}. Give module:function as you would import it from the "
            "current directory, or path/to/file.py:function."
        ) from None


def load_factory(spec: str) -> Callable[..., Any]:
    """``module:function`` (or ``file.py:function``) -> the function."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise SMPConfigError(
            f"The model factory {spec!r} must be MODULE:FUNCTION (e.g. examples.mnist_cnn:make_model or "
            "examples/mnist_cnn.py:make_model)."
        )
    shim.install()  # an unmodified SMP script imports smdistributed.modelparallel.torch, as under `run`
    module = _import_module(target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SMPConfigError(f"{target!r} has no callable {attr!r}; pass the function that builds the model.")
    return factory


@contextlib.contextmanager
def _planning_state(cfg: SMPConfig) -> Iterator[None]:
    """Make smp.partition / set_partition record as after smp.init, without processes; restore afterwards."""
    saved = dict(vars(state))
    state.cfg, state.initialized = cfg, True
    state.topology = Topology.build(
        cfg.pipeline_parallel_degree * cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree,
        cfg.tensor_parallel_degree, cfg.placement_strategy,
    )  # fmt: skip
    clear_records()
    try:
        yield
    finally:
        vars(state).clear()
        vars(state).update(saved)


def _build(factory: Callable[..., Any], kwargs: dict[str, Any]) -> nn.Module:
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise SMPConfigError(
            f"The model factory returned {type(model).__name__}, not an nn.Module; return the model you would "
            "pass to smp.DistributedModel."
        )
    return model


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RankSummary:
    """What one pipeline rank would hold and do."""

    rank: int
    modules: int
    parameters: int
    parameter_bytes: int
    cost: float


@dataclass(frozen=True)
class PlanResult:
    """The plan, the model it is for, the trace it came from, and the per-rank totals."""

    plan: PartitionPlan
    model: nn.Module
    trace: TraceResult
    config: SMPConfig
    ranks: list[RankSummary]


def _own_costs(root: nn.Module, costs: dict[str, float]) -> dict[str, float]:
    """Each module's own share of the partitioner's cost: its subtree cost minus its children's."""
    own = dict(costs)
    for name, module in root.named_modules():
        for child_name, _ in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            own[name] = own.get(name, 0.0) - costs.get(full, 0.0)
    return own


def _runs_on(root: nn.Module, plan: PartitionPlan, trace: TraceResult) -> dict[str, int]:
    """The rank doing each module's own work: placed modules their rank; a stateless leaf the rank of the placed
    module that ran just before it (its input's producer); a stateless container that of its first placed
    descendant; the root, and anything never called, rank 0."""
    leaves = {name for name, module in root.named_modules() if next(module.children(), None) is None}
    where = dict(plan.assignment)
    last = 0
    for name in trace.order:
        if name in plan.assignment:
            last = plan.assignment[name]
        elif name in leaves:
            where.setdefault(name, last)
    for name, _ in root.named_modules():
        if name not in where:
            below = [plan.assignment[n] for n in trace.order if n.startswith(f"{name}.") and n in plan.assignment]
            where[name] = below[0] if name and below else 0
    return where


def rank_summaries(
    root: nn.Module, plan: PartitionPlan, trace: TraceResult, costs: dict[str, float]
) -> list[RankSummary]:
    """Per-rank modules with state, parameters (shared ones counted once) and estimated cost."""
    counts, sizes = plan._param_totals(root)
    own = _own_costs(root, costs)
    where = _runs_on(root, plan, trace)
    cost = [0.0] * plan.pp_size
    for name, value in own.items():
        cost[where.get(name, 0)] += value
    modules = [sum(1 for r in plan.assignment.values() if r == rank) for rank in range(plan.pp_size)]
    return [RankSummary(r, modules[r], counts[r], sizes[r], cost[r]) for r in range(plan.pp_size)]


def plan_model(
    factory: Callable[..., Any],
    specs: Sequence[InputSpec],
    config: dict[str, Any] | None = None,
    factory_kwargs: dict[str, Any] | None = None,
    measure_time: bool = False,
) -> PlanResult:
    """Build, trace microbatch 0 and plan, in this process; the same planner the first smp.step runs."""
    cfg = resolve_config(config or {}, environ={})
    if not specs:
        raise SMPConfigError(
            "No --input given: describe the model's positional inputs, e.g. --input 8x1x28x28:float32."
        )
    with _planning_state(cfg):
        model = _build(factory, factory_kwargs or {})
        inputs = make_inputs(specs, cfg.microbatches)
        model.eval()  # the trace is a shape-and-cost probe: no dropout noise, no BatchNorm statistics update
        trace = trace_modules(model, lambda: model(*inputs), measure_time=measure_time, timing_runs=TIMING_RUNS)
        auto = auto_plan(model, trace, cfg.pipeline_parallel_degree, cfg.memory_weight)
        if cfg.auto_partition:
            plan = auto
        else:
            plan = manual_plan(model, cfg.pipeline_parallel_degree, cfg.default_partition)
            plan = PartitionPlan(plan.assignment, plan.pp_size, plan.method, dict(auto.costs))
        validate_plan(model, plan)
    return PlanResult(plan, model, trace, cfg, rank_summaries(model, plan, trace, auto.costs))


# ---------------------------------------------------------------- command


def _rank_table(result: PlanResult) -> Table:
    total = sum(r.cost for r in result.ranks) or 1.0
    table = Table(title="Per pipeline rank")
    for column in ("rank", "modules with state", "parameters", "parameter bytes", "est. cost", "share"):
        table.add_column(column, justify="right")
    for r in result.ranks:
        table.add_row(str(r.rank), str(r.modules), f"{r.parameters:,}", human_bytes(r.parameter_bytes), f"{r.cost:.3f}",
                      f"{r.cost / total:.0%}")  # fmt: skip
    return table


def _as_json(result: PlanResult) -> str:
    return json.dumps({
        "plan": result.plan.to_dict(),
        "ranks": [vars(r) for r in result.ranks],
        "config": {"pipeline_parallel_degree": result.config.pipeline_parallel_degree,
                   "microbatches": result.config.microbatches, "auto_partition": result.config.auto_partition,
                   "memory_weight": result.config.memory_weight},
    }, indent=2)  # fmt: skip


def plan_command(argv: Sequence[str]) -> int:
    """``smp-compat plan MODULE:FUNCTION --input SPEC --config JSON_OR_FILE``."""
    parser = argparse.ArgumentParser(
        prog="smp-compat plan",
        description="Show the pipeline partition smp_compat would choose for a model (auto, or manual when the "
        "config has auto_partition: false), with per-rank parameter bytes and estimated cost. One process, "
        "no torch.distributed.",
        allow_abbrev=False,
    )
    parser.add_argument("factory", metavar="MODULE:FUNCTION", help="function that returns the model (no arguments)")
    parser.add_argument("--input", required=True, metavar="SPEC",
                        help="the model's positional inputs for one step call: SHAPE[:DTYPE[:HIGH]],... e.g. "
                        "64x1x28x28:float32 or 8x16:int64:50257")  # fmt: skip
    parser.add_argument("--config", metavar="JSON_OR_FILE", help="SMP parameters or a SageMaker distribution dict")
    parser.add_argument("--kwargs", metavar="JSON", help="keyword arguments for the factory, as a JSON object")
    parser.add_argument("--measure-time", action="store_true",
                        help="time modules in the trace (SMP's trace_execution_times), not 1 each")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the plan and per-rank totals as JSON")
    args = parser.parse_args(list(argv))
    kwargs = json.loads(args.kwargs) if args.kwargs else {}
    if not isinstance(kwargs, dict):
        raise SMPConfigError(f"--kwargs must be a JSON object, got {args.kwargs!r}.")
    config = read_launch_config(args.config, environ={}).parameters  # as `smp-compat run --config` reads it
    result = plan_model(load_factory(args.factory), parse_inputs(args.input), config, kwargs, args.measure_time)
    if args.json:
        print(_as_json(result))
        return 0
    console = Console(highlight=False)
    cfg = result.config
    console.print(f"{type(result.model).__name__}: pipeline_parallel_degree {cfg.pipeline_parallel_degree}, "
                  f"microbatches {cfg.microbatches}, {result.plan.method} partition, memory_weight "
                  f"{cfg.memory_weight}; traced microbatch 0 ({len(result.trace.order)} modules called).")  # fmt: skip
    console.print(result.plan.render(result.model))
    console.print(_rank_table(result))
    console.print("est. cost: the partitioner's normalized cost (memory_weight x memory + (1 - memory_weight) x "
                  "compute); a module without state counts on the rank that runs it.")  # fmt: skip
    return 0


main = plan_command
