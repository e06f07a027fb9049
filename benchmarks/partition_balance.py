"""Auto-partition quality: the stage times of the partition smp_compat chooses against the best contiguous split.

For each model and pipeline degree, the plan comes from ``smp-compat plan``'s ``plan_model`` (the planner the
first ``@smp.step`` runs: one traced forward of microbatch 0, then ``auto_plan``), under four cost models
(``COST_MODELS``). Every *unit* of the model (embedding, each transformer block, final norm, head; each
Linear of the MLP with the ReLU after it) is then timed on its own, forward + backward,
``torch.set_num_threads(1)``, median of repeats taken round-robin; a stage's time is the sum over the units
it holds. The best split is found by brute force over every contiguous cut of the same units into pp
stages. Figure of merit: the chosen plan's largest stage time over the best split's, for the cost model
that balances compute (measured times, memory_weight 0); target <= 1.10.

    python benchmarks/partition_balance.py [--pp 2 4 --repeats 9 --clock cpu --json result.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))  # tests/models.py: the transformer Block

from models import Block  # noqa: E402
from pp1_overhead import make_mlp  # noqa: E402

from smp_compat.cli.plan import make_inputs, parse_inputs, plan_model  # noqa: E402

__all__ = ["COST_MODELS", "TARGET", "UnevenTransformer", "best_split", "main", "run"]

TARGET = 1.10
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
# name -> (memory_weight, trace_execution_times, checked against TARGET)
# "time": trace_execution_times=True (measured forward times); "count": SMP's default compute proxy, the
# number of modules in a subtree. mw: memory_weight (0.8 is SMP's default).
COST_MODELS: dict[str, tuple[float, bool, bool]] = {
    "time, mw 0": (0.0, True, True),
    "count, mw 0": (0.0, False, False),
    "count, mw 0.8 (default)": (0.8, False, False),
    "time, mw 0.8": (0.8, True, False),
}


class UnevenTransformer(nn.Module):
    """Embedding, ``layers`` pre-norm blocks, final norm and an untied vocabulary head: a cheap first unit
    and a large last one, as in a language model."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@dataclass
class Unit:
    """A piece the split may not cut: ``call`` runs it, ``capture`` is the module whose input it takes,
    ``state`` the modules with state in it (they must all be on one rank)."""

    name: str
    call: nn.Module
    capture: str
    state: list[str]


@dataclass
class Case:
    """One (model, pp, cost model): the chosen split and the best one, in measured milliseconds."""

    pp: int
    cost_model: str
    memory_weight: float
    traced_times: bool
    checked: bool
    chosen: list[int]  # stage of each unit
    chosen_ms: list[float]
    best: list[int]
    best_ms: list[float]
    ratio: float  # max(chosen_ms) / max(best_ms)


@dataclass
class ModelResult:
    name: str
    units: list[str]
    unit_ms: list[float]  # median forward + backward per unit
    unit_spread: list[float]  # (max - min) / median over repeats: how noisy the machine was
    cases: list[Case] = field(default_factory=list)


@dataclass
class Result:
    args: dict[str, Any]
    load_average: list[float]
    models: list[ModelResult]
    worst_checked_ratio: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline degrees")
    p.add_argument("--tf-vocab", type=int, default=4096, help="transformer vocabulary (head size)")
    p.add_argument("--tf-width", type=int, default=128, help="transformer hidden size")
    p.add_argument("--tf-heads", type=int, default=4)
    p.add_argument("--tf-layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--tf-seq", type=int, default=64)
    p.add_argument("--tf-batch", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--width", type=int, default=1024, help="MLP width (pp_workload.py's)")
    p.add_argument("--layers", type=int, default=8, help="MLP Linear layers")
    p.add_argument("--batch", type=int, default=64, help="MLP samples per microbatch (512 / 8 in pp_workload.py)")
    p.add_argument("--repeats", type=int, default=9, help="timed forward + backward runs of every unit")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs of every unit first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--clock", choices=CLOCKS, default="cpu",
                   help="cpu: the thread's CPU time (what other processes on a busy machine cannot inflate; the "
                   "planner's clock off CUDA); wall: elapsed time (on an idle machine)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    args = p.parse_args(argv)
    if args.repeats < 1 or any(pp < 2 for pp in args.pp):
        p.error("--repeats must be >= 1 and every --pp >= 2")
    return args


# ---------------------------------------------------------------------- the two models
ModelSpec = tuple[Callable[[], nn.Module], str, nn.Module, list[Unit]]  # factory, input spec, model, units


def transformer_model(args: argparse.Namespace) -> ModelSpec:
    def factory() -> nn.Module:
        torch.manual_seed(0)
        return UnevenTransformer(args.tf_vocab, args.tf_width, args.tf_heads, args.tf_layers, args.tf_seq)

    model = factory()
    units = [Unit("emb", model.embed, "embed", ["embed"])]
    for i, block in enumerate(model.blocks):
        state = [f"blocks.{i}.{n}".rstrip(".") for n, m in block.named_modules() if _owns_state(m)]
        units.append(Unit(f"b{i}", block, f"blocks.{i}", state))
    units += [Unit("lnf", model.ln_f, "ln_f", ["ln_f"]), Unit("head", model.head, "head", ["head"])]
    spec = f"{args.tf_batch}x{args.tf_seq}:int64:{args.tf_vocab}"
    return factory, spec, model, units


def mlp_model(args: argparse.Namespace) -> ModelSpec:
    def factory() -> nn.Module:
        return make_mlp(args.width, args.layers)

    model = factory()
    units = []
    for i in range(0, len(model), 2):  # Linear i and the ReLU after it (which runs where the Linear does)
        call = nn.Sequential(*model[i : i + 2])
        units.append(Unit(f"L{i // 2}", call, str(i), [str(i)]))
    return factory, f"{args.batch}x{args.width}:float32", model, units


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


# ---------------------------------------------------------------------- measuring
def _capture_inputs(model: nn.Module, units: list[Unit], inputs: list[torch.Tensor]) -> dict[str, Any]:
    """Each unit's (args, kwargs) in one forward pass of the whole model."""
    modules = dict(model.named_modules())
    seen: dict[str, Any] = {}
    handles = []
    for unit in units:

        def hook(module: nn.Module, args: Any, kwargs: Any, name: str = unit.capture) -> None:
            seen.setdefault(name, (tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))

        handles.append(modules[unit.capture].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _forward_backward(unit: Unit, args: tuple, kwargs: dict, grad: torch.Tensor, clock: Callable[[], float]) -> float:
    """Seconds for one forward + backward of the unit. Parameter gradients accumulate, as for every microbatch
    of a step but the first; the output gradient is made beforehand (the next stage's work). On CPU backward
    runs in the calling thread, so the thread's CPU time covers it."""
    leaves = [a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args]
    start = clock()
    unit.call(*leaves, **kwargs).backward(grad)
    return clock() - start


def measure_units(model: nn.Module, units: list[Unit], inputs: list[torch.Tensor], args: argparse.Namespace
                  ) -> tuple[list[float], list[float]]:  # fmt: skip
    """Median milliseconds per unit and the spread of the repeats, units taken round-robin against drift."""
    captured = _capture_inputs(model, units, inputs)
    prepared = []
    for unit in units:
        unit_args, unit_kwargs = captured[unit.capture]
        with torch.no_grad():
            grad = torch.ones_like(unit.call(*unit_args, **unit_kwargs))
        prepared.append((unit_args, unit_kwargs, grad))
    samples: list[list[float]] = [[] for _ in units]
    for round_ in range(args.warmup + args.repeats):
        for i, unit in enumerate(units):
            seconds = _forward_backward(unit, *prepared[i], CLOCKS[args.clock])
            if round_ >= args.warmup:
                samples[i].append(1e3 * seconds)
    medians = [statistics.median(s) for s in samples]
    spreads = [(max(s) - min(s)) / m if m > 0 else 0.0 for s, m in zip(samples, medians, strict=True)]
    return medians, spreads


# ---------------------------------------------------------------------- splits
def stage_times(stages: list[int], unit_ms: list[float], pp: int) -> list[float]:
    totals = [0.0] * pp
    for stage, ms in zip(stages, unit_ms, strict=True):
        totals[stage] += ms
    return totals


def best_split(unit_ms: list[float], pp: int) -> list[int]:
    """The contiguous cut into ``pp`` non-empty stages with the smallest largest stage, by trying them all
    (independent of the partitioner's dynamic programming); the first found among equals."""
    n = len(unit_ms)
    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = [0, *cuts, n]
        stages = [s for s in range(pp) for _ in range(bounds[s], bounds[s + 1])]
        worst = max(stage_times(stages, unit_ms, pp))
        if best is None or worst < best[0]:
            best = (worst, stages)
    assert best is not None  # pp <= n is checked by the caller
    return best[1]


def chosen_split(assignment: dict[str, int], units: list[Unit]) -> list[int]:
    """The stage of every unit under a plan; a unit whose modules the plan put on two ranks is an error."""
    stages = []
    for unit in units:
        ranks = {assignment[name] for name in unit.state}
        if len(ranks) != 1:
            raise SystemExit(
                f"The plan cuts unit {unit.name} (ranks {sorted(ranks)}): the planner expands a subtree costing more "
                "than half a stage's fair share, so here it may cut inside a block, finer than this benchmark's "
                "units. Use more --tf-layers or a smaller --pp."
            )
        stages.append(ranks.pop())
    return stages


def evaluate(name: str, model_spec: ModelSpec, args: argparse.Namespace) -> ModelResult:
    """Time the units once, then plan under every cost model at every pp and compare with the best split."""
    factory, spec, model, units = model_spec
    specs = parse_inputs(spec)
    unit_ms, spread = measure_units(model, units, make_inputs(specs, 1, seed=1), args)
    result = ModelResult(name, [u.name for u in units], unit_ms, spread)
    for pp in args.pp:
        if pp > len(units):
            raise SystemExit(f"{name} has {len(units)} units, fewer than pp = {pp}")
        best = best_split(unit_ms, pp)
        best_ms = stage_times(best, unit_ms, pp)
        for cost_model, (weight, traced, checked) in COST_MODELS.items():
            config = {"pipeline_parallel_degree": pp, "microbatches": 1, "memory_weight": weight}
            plan = plan_model(factory, specs, config, measure_time=traced).plan
            chosen = chosen_split(plan.assignment, units)
            chosen_ms = stage_times(chosen, unit_ms, pp)
            ratio = max(chosen_ms) / max(best_ms)
            result.cases.append(Case(pp, cost_model, weight, traced, checked, chosen, chosen_ms, best, best_ms, ratio))
    return result


def run(args: argparse.Namespace) -> Result:
    """Both models; the load average is the larger of its values before and after (the machine's busyness)."""
    torch.set_num_threads(args.threads)
    load = list(os.getloadavg())
    models = [
        evaluate(f"transformer: embed + {args.tf_layers} blocks d {args.tf_width} + head {args.tf_vocab}, "
                 f"batch {args.tf_batch} x seq {args.tf_seq}", transformer_model(args), args),
        evaluate(f"MLP: {args.layers} x Linear {args.width}, batch {args.batch}", mlp_model(args), args),
    ]  # fmt: skip
    checked = [case.ratio for m in models for case in m.cases if case.checked]
    load = [max(a, b) for a, b in zip(load, os.getloadavg(), strict=True)]
    return Result(vars(args), load, models, max(checked))


# ---------------------------------------------------------------------- output
def describe(stages: list[int], names: list[str]) -> str:
    """[0, 0, 1, 1, 1] with names a..e -> 'a-b | c-e'."""
    parts = []
    for stage in sorted(set(stages)):
        members = [n for n, s in zip(names, stages, strict=True) if s == stage]
        parts.append(members[0] if len(members) == 1 else f"{members[0]}-{members[-1]}")
    return " | ".join(parts)


def report(result: Result, console: Console) -> None:
    """Per model: the measured unit times, then per pp and cost model the chosen split against the best."""
    load = ", ".join(f"{x:.1f}" for x in result.load_average)
    for model in result.models:
        units = Table(title=f"{model.name}: forward + backward per unit, ms of {result.args['clock']} time "
                      f"(median of {result.args['repeats']})")
        for name in model.units:
            units.add_column(name, justify="right")
        units.add_row(*(f"{ms:.1f}" for ms in model.unit_ms))
        units.add_row(*(f"±{s:.0%}" for s in model.unit_spread))
        units.caption = f"second row: (max - min) / median over the repeats. Load average (1, 5, 15 min): {load}"
        console.print(units)
        table = Table(title=f"{model.name}: chosen partition against the best contiguous split")
        for column in ("pp", "cost model", "chosen split", "stage ms", "max/mean", "best split", "best ms",
                       "max/mean", "chosen / best"):  # fmt: skip
            table.add_column(column, justify="left" if "split" in column or column == "cost model" else "right")
        for case in model.cases:
            ratio = f"{case.ratio:.3f}"
            if case.checked:
                ratio = f"[{'green' if case.ratio <= TARGET else 'red'}]{ratio}[/]"
            table.add_row(
                str(case.pp), case.cost_model, describe(case.chosen, model.units), _ms(case.chosen_ms),
                f"{_imbalance(case.chosen_ms):.2f}", describe(case.best, model.units), _ms(case.best_ms),
                f"{_imbalance(case.best_ms):.2f}", ratio,
            )  # fmt: skip
        table.caption = ("chosen / best: the chosen split's largest stage time over the best split's. time: "
                         "trace_execution_times; count: modules per subtree; mw: memory_weight")  # fmt: skip
        console.print(table)
    verdict = "[green]meets[/green]" if result.worst_checked_ratio <= TARGET else "[red]misses[/red]"
    console.print(f"Worst chosen / best for '{next(iter(COST_MODELS))}': {result.worst_checked_ratio:.3f}; target "
                  f"<= {TARGET} ({verdict}). The other cost models are shown, not checked.")  # fmt: skip


def _ms(values: list[float]) -> str:
    return " ".join(f"{v:.0f}" for v in values)


def _imbalance(values: list[float]) -> float:
    return max(values) / statistics.mean(values)


def main(argv: list[str] | None = None) -> int:
    """Run, print, optionally write JSON; exit status 1 when the target is missed."""
    args = parse_args(argv)
    result = run(args)
    report(result, Console())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(asdict(result), handle, indent=2)
    return 0 if result.worst_checked_ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
