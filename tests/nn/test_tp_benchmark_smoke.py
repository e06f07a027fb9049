"""benchmarks/tp_throughput.py runs end to end at toy sizes (its target is not checked): same losses, minimal bytes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import tp_throughput  # noqa: E402


def test_tp_throughput_runs_and_compares_like_with_like(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tp.json"
    argv = ["--width", "32", "--heads", "4", "--layers", "2", "--batch", "2", "--seq", "8", "--rounds", "1",
            "--steps", "1", "--warmup", "0", "--json", str(out)]  # fmt: skip
    assert tp_throughput.main(argv) in (0, 1)
    assert "median throughput ratio smp/torch" in capfd.readouterr().out
    result = json.loads(out.read_text())
    assert result["first_step_loss"]["smp"] == pytest.approx(result["first_step_loss"]["torch"], rel=1e-5)
    assert result["bytes_per_layer"] == result["megatron_min_bytes_per_layer"]  # prescaled: 2 + 2 all-reduces
