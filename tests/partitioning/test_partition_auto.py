"""Tests for automatic partitioning (auto_plan, split_min_max) and the plan's serialization and display."""

from __future__ import annotations

import itertools
import json
import random
import time

import pytest
import torch
from rich.console import Console
from torch import nn

from smp_compat.errors import PartitionError
from smp_compat.partitioning import PartitionPlan, TraceResult, auto_plan, state_modules, trace_modules, validate_plan
from smp_compat.partitioning.auto import split_min_max


def mlp(layers: int = 8, width: int = 32) -> nn.Sequential:
    """An MLP of equal Linear+ReLU layers (Linears at even indices)."""
    return nn.Sequential(*itertools.chain.from_iterable((nn.Linear(width, width), nn.ReLU()) for _ in range(layers)))


def traced(model: nn.Module, *inputs: torch.Tensor, measure_time: bool = False) -> TraceResult:
    return trace_modules(model, lambda: model(*inputs), measure_time=measure_time)


def plan_for(model: nn.Module, pp: int, *inputs: torch.Tensor, memory_weight: float = 0.8) -> PartitionPlan:
    plan = auto_plan(model, traced(model, *inputs), pp, memory_weight)
    validate_plan(model, plan)
    return plan


class Block(nn.Module):
    """A small pre-norm transformer block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Embedding, a ModuleList of blocks called in a loop, final norm and head (optionally tied)."""

    def __init__(self, blocks: int = 4, d: int = 32, vocab: int = 16, tie: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


TOKENS = torch.zeros(2, 8, dtype=torch.long)


def block_ranks(plan: PartitionPlan, blocks: int) -> list[set[int]]:
    """The ranks holding each block's modules."""
    return [{r for name, r in plan.assignment.items() if name.startswith(f"h.{b}.")} for b in range(blocks)]


# --- balanced splits ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "expected"), [(2, [0] * 4 + [1] * 4), (4, [0, 0, 1, 1, 2, 2, 3, 3])])
def test_equal_mlp_layers_split_evenly(pp: int, expected: list[int]) -> None:
    model = mlp()
    plan = plan_for(model, pp, torch.zeros(16, 32))
    assert [plan.assignment[str(2 * i)] for i in range(8)] == expected
    assert plan.method == "auto" and plan.pp_size == pp
    assert set(plan.assignment) == {str(2 * i) for i in range(8)}  # ReLUs have no state: no rank


@pytest.mark.parametrize("memory_weight", [0.0, 0.5, 1.0])
def test_equal_layers_split_evenly_with_measured_times(memory_weight: float) -> None:
    model = mlp()
    trace = traced(model, torch.zeros(16, 32))
    trace.exclusive_time = {name: 1.0 for name in trace.order}  # identical, noise-free "measurements"
    plan = auto_plan(model, trace, 4, memory_weight)
    assert [plan.assignment[str(2 * i)] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_one_huge_layer_gets_a_rank_to_itself() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2048))
    plan = plan_for(model, 2, torch.zeros(4, 8))
    assert plan.assignment == {"0": 0, "1": 0, "2": 0, "3": 1}
    sizes = plan.param_bytes_per_rank(model)
    assert sizes[1] > 10 * sizes[0]


def test_huge_layer_in_the_middle() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 512), nn.Linear(512, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    plan = plan_for(model, 3, torch.zeros(4, 8))
    assert plan.assignment["1"] != plan.assignment["2"]  # the two big layers are separated
    assert plan.assignment["0"] == 0 and plan.assignment["4"] == 2


def test_tied_embedding_and_head_land_on_one_rank() -> None:
    model = TinyGPT(blocks=4, tie=True)
    plan = plan_for(model, 2, TOKENS)
    assert plan.assignment["wte"] == plan.assignment["head"] == 0  # the first holder in execution order wins
    assert block_ranks(plan, 4) == [{0}, {0}, {1}, {1}]


@pytest.mark.parametrize(("blocks", "pp"), [(4, 2), (8, 2), (8, 4)])
def test_module_list_transformer_splits_blocks_evenly(blocks: int, pp: int) -> None:
    model = TinyGPT(blocks=blocks)
    plan = plan_for(model, pp, TOKENS)
    per_rank = blocks // pp
    assert block_ranks(plan, blocks) == [{b // per_rank} for b in range(blocks)]
    assert plan.assignment["wte"] == 0
    assert plan.assignment["head"] == plan.assignment["ln_f"] == pp - 1


def test_never_called_container_sorts_where_its_children_ran() -> None:
    # "h" (a ModuleList) is never called, yet its blocks run between wte and head: they must sit between them.
    model = TinyGPT(blocks=4)
    trace = traced(model, TOKENS)
    assert "h" not in trace.calls
    plan = auto_plan(model, trace, 4, 0.8)
    ranks = [plan.assignment[name] for name in ("wte", "h.0.ln1", "h.3.ln2", "head")]
    assert ranks == sorted(ranks) and ranks[0] == 0 and ranks[-1] == 3


def test_memory_weight_changes_the_split_when_compute_and_memory_disagree() -> None:
    # One parameter-heavy but cheap layer, then seven light layers whose (fake) times dominate.
    model = nn.Sequential(nn.Linear(64, 64), *(nn.Linear(64, 1) if i == 0 else nn.Linear(1, 1) for i in range(7)))
    trace = traced(model, torch.zeros(2, 64))
    trace.exclusive_time = {name: (0.0 if name in ("", "0") else 1.0) for name in trace.order}
    by_memory = auto_plan(model, trace, 2, 1.0).assignment
    by_compute = auto_plan(model, trace, 2, 0.0).assignment
    assert by_memory == {"0": 0, **{str(i): 1 for i in range(1, 8)}}
    assert [by_compute[str(i)] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


class Wrapped(nn.Module):
    """A module without state whose own forward does the work, around one Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("heavier", [0, 1, 2, 3])
def test_a_stateless_module_is_never_cut_from_its_subtree(heavier: int) -> None:
    # Its own time runs where its Linear runs, so 2 | 2 is the only balanced plan, whichever wrapper the
    # (noisy) clock saw a little slower. Charging own time to a unit of its own used to allow the cut
    # "wrapper 1 | its Linear", which put three wrappers' work on rank 1.
    model = nn.Sequential(*(Wrapped() for _ in range(4)))
    trace = traced(model, torch.zeros(1, 4))
    trace.exclusive_time = {name: 1e-6 for name in trace.order}
    trace.exclusive_time.update({str(i): 0.005 * (1.02 if i == heavier else 1.0) for i in range(4)})
    assert auto_plan(model, trace, 2, 0.0).assignment == {"0.lin": 0, "1.lin": 0, "2.lin": 1, "3.lin": 1}


def test_pp_size_one_puts_everything_on_rank_zero() -> None:
    model = TinyGPT(blocks=2, tie=True)
    plan = plan_for(model, 1, TOKENS)
    assert set(plan.assignment) == set(state_modules(model))
    assert set(plan.assignment.values()) == {0}


def test_more_ranks_than_units_leaves_ranks_empty_but_valid() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plan = plan_for(model, 8, torch.zeros(1, 2))
    assert sorted(plan.assignment.values()) == [0, 1]  # units: [0, 1]; the stateless root has none of its own


class RootParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = mlp(4)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale


def test_root_state_stays_on_rank_zero() -> None:
    model = RootParam()
    plan = plan_for(model, 4, torch.zeros(2, 32))
    assert plan.assignment[""] == 0
    assert plan.assignment["layers.6"] == 3


def test_costs_are_normalized_subtree_costs() -> None:
    model = TinyGPT(blocks=2)
    plan = auto_plan(model, traced(model, TOKENS, measure_time=True), 2, 0.8)
    assert plan.costs[""] == pytest.approx(1.0)
    # "h" is never called and holds nothing itself: its cost is exactly its blocks' costs
    assert plan.costs["h"] == pytest.approx(plan.costs["h.0"] + plan.costs["h.1"], rel=1e-9)
    assert set(plan.costs) == {name for name, _ in model.named_modules()}
    counted = auto_plan(model, traced(model, TOKENS), 2, 0.0)  # compute only, one unit per module
    assert counted.costs["h.0"] == pytest.approx(len(list(model.h[0].modules())) / len(list(model.modules())))


# --- determinism and arguments -------------------------------------------------------------------------


def test_same_inputs_give_the_same_plan() -> None:
    torch.manual_seed(0)
    first_model = TinyGPT(blocks=6, tie=True)
    torch.manual_seed(1)
    second_model = TinyGPT(blocks=6, tie=True)
    first = plan_for(first_model, 4, TOKENS)
    assert plan_for(first_model, 4, TOKENS) == first
    second = plan_for(second_model, 4, TOKENS)
    assert second == first
    assert json.dumps(second.to_dict()) == json.dumps(first.to_dict())


@pytest.mark.parametrize(("pp", "weight"), [(0, 0.5), (True, 0.5), (2, -0.1), (2, 1.5), (2, "0.5")])
def test_bad_arguments(pp: object, weight: object) -> None:
    model = mlp(2)
    with pytest.raises(PartitionError):
        auto_plan(model, TraceResult(), pp, weight)  # type: ignore[arg-type]


def test_works_without_any_trace_data() -> None:
    plan = auto_plan(mlp(), TraceResult(), 2, 0.8)
    assert [plan.assignment[str(2 * i)] for i in range(8)] == [0] * 4 + [1] * 4


class Scalar(nn.Module):
    """A module with one parameter, cheaper to build by the thousand than nn.Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


def test_ten_thousand_modules_is_fast() -> None:
    model = nn.Sequential(*(nn.Sequential(*(Scalar() for _ in range(100))) for _ in range(100)))
    names = [name for name, _ in model.named_modules()]
    trace = TraceResult(order=names, output_bytes={n: 4 for n in names}, calls={n: 1 for n in names})
    start = time.perf_counter()
    plan = auto_plan(model, trace, 8, 0.8)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0
    counts = [list(plan.assignment.values()).count(r) for r in range(8)]
    assert max(counts) - min(counts) <= 100  # within one group of 100 layers of perfect balance


# --- the DP itself ---------------------------------------------------------------------------------------


def _brute_force_best(costs: list[float], segments: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), segments - 1):
        bounds = (0, *cuts, len(costs))
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_split_min_max_matches_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        costs = [rng.choice([0.0, 0.5, 1.0, 2.0, rng.random() * 3]) for _ in range(n)]
        segments = rng.randint(1, n)
        owner = split_min_max(costs, segments)
        assert owner[0] == 0 and owner[-1] == segments - 1
        assert all(b - a in (0, 1) for a, b in itertools.pairwise(owner))  # contiguous, non-empty, in order
        achieved = max(sum(c for c, o in zip(costs, owner, strict=True) if o == s) for s in range(segments))
        assert achieved == pytest.approx(_brute_force_best(costs, segments), abs=1e-9)


def test_split_min_max_rejects_impossible_requests() -> None:
    with pytest.raises(ValueError):
        split_min_max([1.0], 2)


# --- plan serialization and display -----------------------------------------------------------------------


def test_plan_round_trips_through_json() -> None:
    model = TinyGPT(blocks=2, tie=True)
    plan = plan_for(model, 2, TOKENS)
    again = PartitionPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    manual = PartitionPlan(assignment={"0": 1}, pp_size=2, method="manual")
    assert PartitionPlan.from_dict(manual.to_dict()) == manual


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"assignment": {}, "pp_size": 2}, "lacks the keys"),
        ({"assignment": {"a": "1"}, "pp_size": 2, "method": "auto"}, "not an integer"),
        ({"assignment": {}, "pp_size": 2, "method": "magic"}, "method 'magic'"),
    ],
)
def test_plan_from_bad_dict(data: dict[str, object], match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        PartitionPlan.from_dict(data)


def test_render_lists_every_module_and_per_rank_totals() -> None:
    model = TinyGPT(blocks=2, tie=True)
    plan = plan_for(model, 2, TOKENS)
    console = Console(record=True, width=200)
    console.print(plan.render(model))
    text = console.export_text()
    for name in plan.assignment:
        assert f" {name} " in text
    counts = [0, 0]
    for _, rank, count, cost in plan.rows(model):
        counts[rank] += count
        assert cost is not None and cost >= 0
    # the tied weight shows on both rows but counts once in the caption
    assert counts[0] - model.wte.weight.numel() == sum(
        p.numel() for n, p in model.named_parameters() if plan.assignment[n.rpartition(".")[0]] == 0
    )
    assert f"0: {counts[0] - model.wte.weight.numel():,} parameters" in text
