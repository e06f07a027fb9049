"""The last screen of a failed job names the cause: exception type, message, rank and module (issue 10).

A module on pipeline rank 1 raises; rank 0 gets a ``RemoteError``. The one-line failure every rank
prints leads with the original exception, and the failing ranks write torch elastic's error file, so
torchrun's closing "Root Cause" shows it (it printed ``error_file: <N/A>`` before). The job under
torchrun itself is ``test_pp_failures.py::test_failure_under_smp_compat_run_ends_the_job_within_seconds``
(one launch serves both), which checks the job's last 10 lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import smp_compat as smp
from models import fail_in_backward
from smp_compat.errors import RemoteError
from smp_compat.failure import ERROR_FILE_ENV, RootCause, root_of, summary, write_error_file
from smp_compat.testing import RankFailure, run_ranks

__all__: list[str] = []

D = 4
MESSAGE = "boom from the faulty layer"


class Faulty(nn.Module):
    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.phase == "forward":
            raise ValueError(f"{MESSAGE}\nsecond line")
        return fail_in_backward(self.lin(h), KeyError("lost gradient"))


class Net(nn.Module):
    def __init__(self, phase: str) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        with smp.partition(1):
            self.faulty = Faulty(phase)
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.faulty(self.inp(x)))


def _job(phase: str, out: str) -> dict[str, Any]:
    """Rank function: one step whose rank-1 module fails in ``phase``; rank 0 writes what it caught to ``out``."""
    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(Net(phase))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    try:
        train_step(model, torch.randn(2, D), torch.randn(2, 1))
    except RemoteError as exc:
        Path(out).write_text(summary(exc))
        raise
    return {}


# ---------------------------------------------------------------- the root cause travels with the error


@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        ("forward", RootCause("ValueError", MESSAGE, 1, "faulty", "microbatch 0, forward")),
        ("backward",
         RootCause("KeyError", "'lost gradient'", 1, None, "microbatch 0, backward from the output of 'faulty'")),
    ],
)
def test_a_remote_error_carries_the_root_exception_rank_and_module(
    phase: str, expected: RootCause, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "caught.txt"
    with pytest.raises(RankFailure):
        run_ranks(_job, 2, phase, str(out), timeout=30)
    assert out.read_text() == expected.line()
    stopping = [line for line in capfd.readouterr().err.splitlines() if "stopping rank 1 because" in line]
    assert stopping and stopping[0].endswith(f"because rank 0: {expected.line()}"), stopping


def test_root_of_keeps_a_carried_root_and_otherwise_names_this_rank() -> None:
    carried = RootCause("ValueError", "x", 3, "layer", "microbatch 1, forward")
    assert root_of(RemoteError("text", carried), rank=0) is carried
    assert summary(RemoteError("text", carried)) == carried.line()
    assert carried.line() == "ValueError: x [raised on rank 3 in module 'layer', microbatch 1, forward]"
    local = root_of(ValueError("first\nsecond"), rank=2)
    assert local == RootCause("ValueError", "first", 2) and local.line() == "ValueError: first [raised on rank 2]"
    assert summary(RemoteError("plain\nmore")) == "smp_compat.errors.RemoteError: plain"
    assert summary(KeyError()) == "KeyError"


def test_torchrun_reads_the_error_file_and_shows_the_root_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    details = "Traceback ...\nValueError: boom\n\nsmp_compat: rank 0 failed"
    write_error_file("ValueError: boom [raised on rank 1]", details)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    report = str(ChildFailedError("train.py", {0: failure}))
    assert "error_file: <N/A>" not in report and "ValueError: boom" in report
    assert report.rstrip().splitlines()[-2].strip() == "smp_compat: rank 0 failed"
