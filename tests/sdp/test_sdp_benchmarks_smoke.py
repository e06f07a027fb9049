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


def test_bf16_modes_compare_with_plain_fsdp2_on_fp32_shards(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    memory, throughput = tmp_path / "memory.json", tmp_path / "throughput.json"
    toy = ["--world", "2", "--width", "32", "--layers", "2", "--steps", "1", "--precision", "bf16"]
    assert sdp_memory.main([*toy, "--json", str(memory)]) == 0
    results = json.loads(memory.read_text())["results"]
    assert results["smp"]["params"] == results["fsdp2"]["params"] == results["fsdp2"]["full_params"] // 2  # fp32
    assert results["smp"]["optimizer"] == results["fsdp2"]["optimizer"] == 2 * results["smp"]["params"]
    assert sdp_throughput.main([*toy, "--rounds", "1", "--warmup", "1", "--json", str(throughput)]) in (0, 1)
    assert "bf16" in capfd.readouterr().out
    result = json.loads(throughput.read_text())
    assert set(result["per_round"]) == {"smp", "fsdp2"}
    assert result["first_losses"]["smp"] == pytest.approx(result["first_losses"]["fsdp2"], rel=1e-3)
