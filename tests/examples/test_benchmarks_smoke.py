"""The pipeline benchmarks run end to end at toy sizes, so they cannot rot (their targets are not checked)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import pp_bytes  # noqa: E402
import pp_memory  # noqa: E402
import pp_rss  # noqa: E402
import pp_throughput  # noqa: E402
import thread_spread  # noqa: E402

TINY = ["--width", "32", "--batch", "16", "--microbatches", "4"]


def test_throughput_runs_and_compares_like_with_like(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "throughput.json"
    argv = [*TINY, "--rounds", "1", "--steps", "1", "--warmup", "1", "--json", str(out)]
    assert pp_throughput.main(argv) in (0, 1)
    printed = capfd.readouterr().out
    assert "Schedule1F1B" in printed and "Idle fraction" in printed
    result = json.loads(out.read_text())
    assert set(result["samples_per_s"]) == {*pp_throughput.SMP_VARIANTS, *pp_throughput.TORCH_VARIANTS}
    assert all(rate[0] > 0 for rate in result["samples_per_s"].values())
    assert result["ratio_1f1b"]["torch-1F1B"] == pytest.approx(1.0)
    assert result["ideal_idle"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1) at p=2, m=4
    for idle in result["idle"].values():
        assert all(0.0 <= i <= 1.0 for i in idle)
    # both libraries start from the same weights and batch: the first step's losses agree
    smp_losses, torch_losses = result["first_step_losses"]["smp"], result["first_step_losses"]["torch"]
    assert len(smp_losses) == len(torch_losses) == 4
    assert smp_losses == pytest.approx(torch_losses, rel=1e-5)


def test_memory_runs_and_releases_everything(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "memory.json"
    assert pp_memory.main([*TINY, "--steps", "1", "--json", str(out)]) in (0, 1)
    assert "peak activation memory" in capfd.readouterr().out
    result = json.loads(out.read_text())
    assert all(unit > 0 for unit in result["unit_bytes"])
    for variant, peaks in result["peak_max"].items():
        assert all(p > 0 for p in peaks), variant
        assert result["residual"][variant] == [0, 0], variant  # every saved activation was released


def test_bytes_runs_and_tallies_match_the_engine(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bytes.json"
    argv = [*TINY, "--tf-batch", "8", "--tf-seq", "4", "--tf-width", "8", "--steps", "1", "--json", str(out)]
    assert pp_bytes.main(argv) in (0, 1)
    assert "must cross" in capfd.readouterr().out
    models = json.loads(out.read_text())["models"]
    assert len(models) == 2
    for model in models:
        tallied = sum(nbytes for nbytes, _ in model["by_kind"].values())
        assert tallied == model["bytes_sent_delta"] > 0, model["name"]
        assert model["by_kind"]["end_step"][1] == 1  # one end-of-step message per measured step (rank 0 -> 1)


def test_saved_tensor_meter_counts_and_releases() -> None:
    import torch
    from torch import nn

    meter = pp_memory.SavedTensorMeter()
    net = meter.instrument(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)))
    meter.exclude_parameters(net)
    out = net(torch.randn(4, 8))
    # Linear 0 saves its input, ReLU its output (Linear 1's input, the same tensor): 2 x 4 x 8 floats
    assert meter.current == 2 * 4 * 8 * 4
    out.sum().backward()
    del out
    assert meter.current == 0 and meter.peak == 2 * 4 * 8 * 4


def test_rss_runs_both_libraries(capfd: pytest.CaptureFixture[str]) -> None:
    # the verdict is not checked: a few steps cannot tell allocator noise from growth
    assert pp_rss.main([*TINY, "--warmup", "1", "--steps", "2"]) in (0, 1)
    printed = capfd.readouterr().out
    assert "smp-interleaved" in printed and "torch-1F1B" in printed


def test_thread_spread_runs_and_restores_the_process(capfd: pytest.CaptureFixture[str]) -> None:
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    assert thread_spread.main(["--width", "16", "--microbatch", "4", "--rounds", "2", "--steps", "1"]) == 0
    assert "ratio" in capfd.readouterr().out
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
