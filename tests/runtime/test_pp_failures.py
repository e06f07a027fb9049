"""Pipeline failures end every rank within seconds with the original error shown: never a silent hang.

Each case runs 2 CPU ranks with ``run_ranks`` and measures the whole call: a module on rank 1 that raises
in forward or in backward, a step body that raises on rank 0, and a rank 1 module that takes longer than
``SMP_PIPELINE_TIMEOUT_S``. Ranks that did not fail themselves are stopped by the failure watch (exit 17).
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp_compat as smp
from models import fail_in_backward
from smp_compat.testing import RankFailure, run_ranks

D = 8
BOUND_S = 15.0  # the whole run_ranks call, start-up included
WATCH_EXIT = 17  # smp_compat.failure's exit code for "another rank failed"
_STEP = [0]  # the training loop's step index, visible to modules in the same process


class Faulty(nn.Module):
    """Misbehaves on the second step (index 1), or sleeps, depending on ``fault``."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        if self.fault == "sleep":
            time.sleep(10)
        elif _STEP[0] == 1 and self.fault == "forward":
            raise ValueError("boom")
        elif _STEP[0] == 1 and self.fault == "backward":
            h = fail_in_backward(h, RuntimeError("backward exploded"))
        return h


class Net(nn.Module):
    def __init__(self, fault: str) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        with smp.partition(1):
            self.faulty = Faulty(fault)
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.faulty(self.inp(x)))


def _job(fault: str) -> str:
    """Rank function: three training steps; ``fault`` says what goes wrong and where."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    torch.manual_seed(0)
    model = smp.DistributedModel(Net(fault))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        if fault == "body" and _STEP[0] == 1:
            raise RuntimeError("the step body failed on purpose")
        model.backward(loss)
        return loss

    x, y = torch.randn(4, D), torch.randn(4, 1)
    for step in range(3):
        if fault == "leave" and step == 1 and smp.pp_rank() == 1:
            return "left early"  # a script bug: this rank stops making the step calls
        _STEP[0] = step
        optimizer.zero_grad()
        train_step(model, x, y)
        optimizer.step()
    return "finished"


def _fail(fault: str, env: dict[str, str] | None = None) -> tuple[dict[int, str], float]:
    """Run the job, expect RankFailure; return each rank's report paragraph and the elapsed seconds."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_job, 2, fault, timeout=30, env=env)
    elapsed = time.monotonic() - start
    return _sections(str(info.value)), elapsed


def _sections(report: str) -> dict[int, str]:
    """RankFailure's message has one paragraph per failed rank, each starting with 'rank N'."""
    parts = re.split(r"^(?=rank \d+[: ])", report, flags=re.M)
    return {int(p.split()[1].rstrip(":")): p for p in parts if p.startswith("rank ")}


def _stopped_by_watch(section: str) -> bool:
    return f"exited with code {WATCH_EXIT}" in section


def test_module_error_on_rank_1_ends_every_rank_with_the_message(capfd: pytest.CaptureFixture[str]) -> None:
    ranks, elapsed = _fail("forward")
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    rank0 = ranks[0]
    assert "raised" in rank0 and "RemoteError" in rank0, rank0
    assert "ValueError: boom" in rank0, rank0  # the original error and its traceback on rank 1
    assert "faulty" in rank0 and "rank 1" in rank0, rank0  # which module, on which rank
    assert "microbatch" in rank0 and "forward" in rank0, rank0
    assert _stopped_by_watch(ranks[1]), ranks[1]
    assert "stopping rank 1 because rank 0" in capfd.readouterr().err


def test_step_body_error_on_rank_0_stops_rank_1(capfd: pytest.CaptureFixture[str]) -> None:
    ranks, elapsed = _fail("body")
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    assert "RuntimeError: the step body failed on purpose" in ranks[0], ranks[0]
    assert _stopped_by_watch(ranks[1]), ranks[1]
    err = capfd.readouterr().err
    assert "stopping rank 1 because rank 0: RuntimeError: the step body failed on purpose" in err, err[-3000:]


def test_a_rank_that_leaves_early_is_named_at_once_not_after_the_pipeline_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_job, 2, "leave", timeout=30)  # rank 0 waited SMP_PIPELINE_TIMEOUT_S (300 s) for it
    assert time.monotonic() - start < BOUND_S
    assert "rank 1 left the job" in _sections(str(info.value))[0]


def test_backward_error_on_rank_1_ends_every_rank_with_the_message() -> None:
    ranks, elapsed = _fail("backward")
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    rank0 = ranks[0]
    assert "RuntimeError: backward exploded" in rank0, rank0
    assert "rank 1" in rank0 and "backward" in rank0 and "microbatch" in rank0, rank0  # where and when
    assert _stopped_by_watch(ranks[1]), ranks[1]


def test_slow_rank_gives_a_timeout_naming_what_rank_0_waits_for() -> None:
    ranks, elapsed = _fail("sleep", env={"SMP_PIPELINE_TIMEOUT_S": "3"})
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"  # well before the 10 s sleep ends plus the step
    rank0 = ranks[0]
    assert "SMPTimeoutError" in rank0, rank0
    message = rank0[rank0.index("SMPTimeoutError") :]
    assert "forward of faulty on rank 1 (microbatch 0)" in message, message  # what, where, which microbatch
    assert "SMP_PIPELINE_TIMEOUT_S" in message, message  # how to wait longer
    assert _stopped_by_watch(ranks[1]), ranks[1]


_SCRIPT = '''
import time
import torch
import torch.nn.functional as F
from torch import nn
import smdistributed.modelparallel.torch as smp

class Faulty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        if self.calls > 2:  # the second step (2 microbatches a step)
            print(f"FAILING AT {time.time()}", flush=True)
            raise ValueError("boom from the faulty layer")
        return self.lin(h)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        with smp.partition(1):
            self.faulty = Faulty()
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.faulty(self.inp(x)))

@smp.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss

smp.init()
model = smp.DistributedModel(Net())
for step in range(5):
    train_step(model, torch.randn(4, 8), torch.randn(4, 1))
print("FINISHED", flush=True)
'''


def test_failure_under_smp_compat_run_ends_the_job_within_seconds(tmp_path: Any) -> None:
    """The real launcher path: the error leaves rank 0 through sys.excepthook, not through run_ranks."""
    from launching import clean_env, free_port, smp_compat_command

    script = tmp_path / "fail_job.py"
    script.write_text(_SCRIPT)
    config = '{"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": false, "default_partition": 0}'
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--config", config, str(script)]  # fmt: skip
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=90)
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "FINISHED" not in output, output[-4000:]
    failed_at = float(re.search(r"FAILING AT ([\d.]+)", output).group(1))  # type: ignore[union-attr]
    assert ended - failed_at < BOUND_S, f"the job took {ended - failed_at:.1f} s to end after the failure"
    assert "ValueError: boom" in output and "RemoteError" in output, output[-4000:]
    assert "stopping rank 1 because rank 0" in output, output[-4000:]
    last = "\n".join(output.rstrip().splitlines()[-10:])  # torchrun's "Root Cause", from our error file
    for needle in ("ValueError", "boom from the faulty layer", "rank 1", "'faulty'"):
        assert needle in last, f"{needle!r} not in the job's last 10 lines:\n{last}"
    assert "error_file: <N/A>" not in output, output[-4000:]
