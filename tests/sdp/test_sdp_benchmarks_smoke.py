"""The sharded-DP benchmarks run end to end at toy sizes, so they cannot rot (timing targets are not checked)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import sdp_memory  # noqa: E402
import sdp_throughput  # noqa: E402


def test_sdp_memory_reports_state_falling_as_one_over_sdp(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "memory.json"
    argv = ["--width", "32", "--layers", "2", "--world", "4", "--steps", "1", "--json", str(out)]
    assert sdp_memory.main(argv) == 0  # the 1/sdp target holds exactly on this even-sized model
    assert "Per-rank model state" in capfd.readouterr().out
    results = json.loads(out.read_text())["results"]
    for sdp in ("2", "4"):
        assert results[sdp]["optimizer"] * int(sdp) == results["1"]["optimizer"]
        assert results[sdp]["grads"] * int(sdp) == results["1"]["grads"]


def test_sdp_throughput_runs_all_three_from_the_same_weights(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "throughput.json"
    argv = ["--world", "2", "--width", "32", "--layers", "2", "--rounds", "1", "--steps", "1", "--warmup", "1",
            "--json", str(out)]  # fmt: skip
    assert sdp_throughput.main(argv) in (0, 1)
    assert "plain FSDP2" in capfd.readouterr().out
    result = json.loads(out.read_text())
    assert all(t[0] > 0 for t in result["per_round"].values())
    first = result["first_losses"]
    assert first["smp"] == pytest.approx(first["fsdp2"], rel=1e-5) == pytest.approx(first["ddp"], rel=1e-5)
