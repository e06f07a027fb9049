"""benchmarks/pptp_lockstep.py runs end to end at toy sizes (timings are not checked): lockstep sends decisions."""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import pptp_lockstep  # noqa: E402


def test_pptp_lockstep_benchmark_runs(capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["--hidden", "16", "--layers", "2", "--batch", "8", "--microbatches", "2", "--rounds", "1", "--steps", "1",
            "--warmup", "0"]  # fmt: skip
    assert pptp_lockstep.main(argv) == 0
    out = capfd.readouterr().out
    assert "lockstep cost (lockstep-1 / free-1" in out
    decisions = re.findall(r"tp leader of stage (\d): decisions per step \{'lockstep-1': (\d+), 'free-1': 0", out)
    assert sorted(stage for stage, _ in decisions) == ["0", "1"] and all(int(n) > 0 for _, n in decisions)
