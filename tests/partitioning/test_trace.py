"""Tests for tracing a forward pass: call order, output sizes, call counts, exclusive times."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from smp_compat.partitioning import trace_modules
from smp_compat.partitioning.trace import output_bytes


class Reordered(nn.Module):
    """Registers a, b, c but calls c, a, then a again and b; `unused` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Sequential(nn.Linear(8, 2), nn.ReLU())
        self.c = nn.Identity()
        self.unused = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        x = self.c(x)
        first = self.a(x)
        self.a(x[:1])
        return self.b(first) * scale


def test_order_is_first_call_order_and_calls_are_counted() -> None:
    model = Reordered()
    x = torch.zeros(3, 4)
    result = trace_modules(model, lambda: model(x, scale=2.0))
    assert result.order == ["", "c", "a", "b", "b.0", "b.1"]
    assert result.calls == {"": 1, "c": 1, "a": 2, "b": 1, "b.0": 1, "b.1": 1}
    assert "unused" not in result.output_bytes
    assert result.exclusive_time == {}


def test_output_bytes_come_from_the_first_call() -> None:
    model = Reordered().double()
    result = trace_modules(model, lambda: model(torch.zeros(3, 4, dtype=torch.float64)))
    assert result.output_bytes["a"] == 3 * 8 * 8  # the first call (3 rows), not the 1-row second call
    assert result.output_bytes["c"] == 3 * 4 * 8
    assert result.output_bytes["b.0"] == 3 * 2 * 8
    assert result.output_bytes[""] == 3 * 2 * 8


@dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    note: str


class Returns(nn.Module):
    """Returns whatever its ``make`` callable builds, to test output shapes."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def forward(self) -> Any:
        return self.make()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: torch.zeros(5), 20),
        (lambda: (torch.zeros(2), torch.zeros(3, dtype=torch.int8), None), 8 + 3),
        (lambda: {"loss": torch.zeros(()), "aux": [torch.zeros(4), 7]}, 4 + 16),
        (lambda: OrderedDict(x=torch.zeros(2, dtype=torch.float16)), 4),
        (lambda: Output(torch.zeros(2), (torch.zeros(1), torch.zeros(3)), "hi"), 8 + 4 + 12),
        (lambda: "text", 0),
        (lambda: None, 0),
    ],
)
def test_output_bytes_of_pytrees_and_dataclasses(make: Any, expected: int) -> None:
    model = Returns(make)
    result = trace_modules(model, lambda: model())
    assert result.output_bytes[""] == expected


def test_a_tensor_repeated_in_an_output_counts_once() -> None:
    t = torch.zeros(10)
    assert output_bytes((t, t, {"again": t})) == 40


def spin(seconds: float) -> None:
    """Busy for ``seconds`` of this thread's CPU time (the trace's clock off CUDA)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Sleeper(nn.Module):
    """Busy for ``seconds`` in its own code, then calls its children."""

    def __init__(self, seconds: float, *children: nn.Module) -> None:
        super().__init__()
        self.seconds = seconds
        self.kids = nn.ModuleList(children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spin(self.seconds)
        for kid in self.kids:
            x = kid(x)
        return x


def test_exclusive_time_excludes_children_and_sums_to_total() -> None:
    model = Sleeper(0.02, Sleeper(0.01), Sleeper(0.03, Sleeper(0.01)))
    start = time.perf_counter()
    result = trace_modules(model, lambda: (model(torch.zeros(1)), model.kids[0](torch.zeros(1))), measure_time=True)
    wall = time.perf_counter() - start
    times = result.exclusive_time
    assert all(value >= 0 for value in times.values())
    assert "kids" not in times  # a ModuleList is never called
    assert times[""] == pytest.approx(0.02, abs=0.015)
    assert times["kids.0"] == pytest.approx(0.02, abs=0.015)  # two calls of 10 ms, summed
    assert times["kids.1"] == pytest.approx(0.03, abs=0.015)
    assert times["kids.1.kids.0"] == pytest.approx(0.01, abs=0.015)
    assert result.calls["kids.0"] == 2
    assert 0.08 <= sum(times.values()) <= wall


def test_runs_without_grad_and_removes_hooks() -> None:
    seen: list[bool] = []

    class Probe(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_grad_enabled())
            return super().forward(x)

    model = nn.Sequential(Probe(2, 2))
    trace_modules(model, lambda: model(torch.zeros(1, 2)), measure_time=True)
    assert seen == [False]
    assert torch.is_grad_enabled()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_hooks_are_removed_when_the_run_fails() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("bad input")

    model = nn.Sequential(nn.Linear(2, 2), Fails())
    with pytest.raises(ValueError, match="bad input"):
        trace_modules(model, lambda: model(torch.zeros(1, 2)), measure_time=True)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_module_registered_twice_is_traced_under_its_first_name() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    result = trace_modules(model, lambda: model(torch.zeros(1, 2)))
    assert result.order == ["", "0", "1"]
    assert result.calls["0"] == 2
