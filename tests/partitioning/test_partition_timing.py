"""Measured times for the auto-partitioner: warm replays, not the cold traced pass (issue 14, item 3)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from smp_compat.cli.plan import parse_inputs, plan_model
from smp_compat.partitioning import trace_modules


def spin(seconds: float) -> None:
    """Busy for ``seconds`` of this thread's CPU time (the trace's clock off CUDA)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Work(nn.Module):
    """A layer with state whose forward takes ``seconds``, and ``first`` on its first call only (first-call
    work: allocations, lazy initialization, cold caches)."""

    def __init__(self, seconds: float, first: float | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seconds, self.first, self.calls = seconds, first, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        spin(self.first if self.first is not None and self.calls == 1 else self.seconds)
        return self.lin(x)


def _slow_first_call() -> nn.Module:
    return nn.Sequential(Work(0.005, first=0.1), Work(0.005), Work(0.005), Work(0.005))


def test_a_slow_first_call_does_not_unbalance_the_plan() -> None:
    # Four equal layers: 2 | 2. The traced pass alone saw layer 0 take 25x longer and gave it a rank alone.
    config = {"pipeline_parallel_degree": 2, "memory_weight": 0.0}
    result = plan_model(_slow_first_call, parse_inputs("2x4:float32"), config, measure_time=True)
    assert result.plan.assignment == {"0.lin": 0, "1.lin": 0, "2.lin": 1, "3.lin": 1}
    assert result.trace.exclusive_time["0"] < 0.05


def test_replays_take_the_smallest_time_and_leave_no_trace() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), Work(0.005, first=0.1))
    model.train()
    x = torch.randn(8, 4)
    reference = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("3.")})
    torch.manual_seed(1)
    with torch.no_grad():
        reference(x)
    expected_rng = torch.get_rng_state()
    torch.manual_seed(1)
    result = trace_modules(model, lambda: model(x), measure_time=True, timing_runs=3)
    assert 0.0045 <= result.exclusive_time["3"] < 0.05  # the warm time, not the first call's 0.1 s
    assert result.calls["3"] == 1 and model[3].calls == 4  # the trace's own records cover one pass
    assert torch.equal(torch.get_rng_state(), expected_rng)  # the replays' dropout draws were undone
    assert torch.equal(model[1].running_mean, reference[1].running_mean)  # as after one forward pass
    assert model[1].num_batches_tracked.item() == 1


def test_a_forward_that_cannot_run_twice_keeps_the_traced_times(caplog: pytest.LogCaptureFixture) -> None:
    class Once(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if getattr(self, "ran", False):
                raise RuntimeError("called twice")
            self.ran = True
            return super().forward(x)

    model = nn.Sequential(Once(4, 4), nn.Linear(4, 4))
    with caplog.at_level("WARNING", logger="smp_compat"):
        result = trace_modules(model, lambda: model(torch.zeros(1, 4)), measure_time=True, timing_runs=3)
    assert set(result.exclusive_time) == {"", "0", "1"}
    assert "called twice" in caplog.text and "traced pass alone" in caplog.text


def test_without_timing_runs_the_traced_pass_alone_is_timed() -> None:
    model = _slow_first_call()
    result = trace_modules(model, lambda: model(torch.zeros(1, 4)), measure_time=True)
    assert result.exclusive_time["0"] >= 0.1 and model[0].calls == 1


def test_a_pause_of_the_process_is_not_charged_to_the_module_it_interrupts() -> None:
    class Paused(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.2)  # the process is off the CPU, as when another process takes the core
            return super().forward(x)

    model = nn.Sequential(Paused(4, 4), nn.Linear(4, 4))
    result = trace_modules(model, lambda: model(torch.zeros(1, 4)), measure_time=True)
    assert result.exclusive_time["0"] < 0.05


# ---------------------------------------------------------------------- the first step on 2 ranks
STEPS = 2


def _seeded_model() -> nn.Module:
    torch.manual_seed(0)
    return _slow_first_call()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _seeded_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            loss = nn.functional.mse_loss(model(xs), ys) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train_ranks() -> dict[str, object]:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "memory_weight": 0.0, "pipeline": "simple"})
    model = smp.DistributedModel(_seeded_model(), trace_execution_times=True)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(model, x, y):  # type: ignore[no-untyped-def]
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for x, y in _batches():
        opt.zero_grad()
        out = step(model, x, y)
        opt.step()
        losses.append(sum(out.outputs).item() / 2)
    return {"losses": losses, "plan": model.pipeline_engine.plan.assignment, "state": model.local_state_dict()}


def test_first_step_with_trace_execution_times_is_balanced_and_faithful() -> None:
    from smp_compat.testing import run_ranks

    losses, state = _reference()
    results = run_ranks(_train_ranks, 2, timeout=90)
    plan = results[0]["plan"]
    assert plan == {"0.lin": 0, "1.lin": 0, "2.lin": 1, "3.lin": 1}  # not 0 | 1, 2, 3 as the cold pass said
    for result in results:
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        for key, value in result["state"].items():
            if key.startswith("_smp"):  # the local dict's markers
                continue
            assert torch.allclose(value, state[key], rtol=1e-5, atol=1e-6), key
