"""benchmarks/partition_balance.py runs end to end at toy sizes (its target is not checked here)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import partition_balance  # noqa: E402

from smp_compat.partitioning.auto import split_min_max  # noqa: E402

TINY = ["--tf-vocab", "64", "--tf-width", "16", "--tf-heads", "2", "--tf-layers", "12", "--tf-seq", "8",
        "--tf-batch", "2", "--width", "32", "--batch", "4", "--repeats", "1", "--warmup", "0"]  # fmt: skip


def test_runs_and_compares_every_cost_model_with_the_best_split(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "balance.json"
    assert partition_balance.main([*TINY, "--json", str(out)]) in (0, 1)
    assert "best contiguous split" in capfd.readouterr().out
    result = json.loads(out.read_text())
    assert len(result["load_average"]) == 3
    assert [len(m["units"]) for m in result["models"]] == [12 + 3, 8]  # emb, 12 blocks, lnf, head; 8 Linears
    for model in result["models"]:
        assert all(ms > 0 for ms in model["unit_ms"])
        assert len(model["cases"]) == 2 * len(partition_balance.COST_MODELS)  # pp 2 and 4
        for case in model["cases"]:
            assert case["chosen"] == sorted(case["chosen"])  # contiguous, in execution order
            assert sum(case["chosen_ms"]) == pytest.approx(sum(model["unit_ms"]))
            assert case["ratio"] >= 1 - 1e-9  # nothing contiguous beats the brute-force best
    checked = [c["ratio"] for m in result["models"] for c in m["cases"] if c["checked"]]
    assert result["worst_checked_ratio"] == max(checked)


def test_best_split_is_the_brute_force_optimum() -> None:
    costs = [1.0, 9.0, 1.0, 1.0, 4.0, 4.0, 1.0]
    for pp in (2, 3, 4):
        stages = partition_balance.best_split(costs, pp)
        best = max(partition_balance.stage_times(stages, costs, pp))
        dp = split_min_max(costs, pp)
        assert best == pytest.approx(max(partition_balance.stage_times(dp, costs, pp)))
    assert partition_balance.best_split(costs, 2) == [0, 0, 1, 1, 1, 1, 1]  # 10 | 11
    assert partition_balance.describe([0, 0, 1, 1, 1, 1, 1], list("abcdefg")) == "a-b | c-g"
