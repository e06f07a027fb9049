"""benchmarks/v2_step.py runs end to end at a toy size, so it cannot rot (timing targets are not checked)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))

import v2_step  # noqa: E402

pytestmark = pytest.mark.hf


def test_v2_step_trains_both_variants_alike(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "v2_step.json"
    argv = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "64", "--seq", "16",
            "--batch", "2", "--rounds", "1", "--steps", "1", "--warmup", "2", "--json", str(out)]  # fmt: skip
    assert v2_step.main(argv) in (0, 1)
    assert "tsm / plain throughput" in capfd.readouterr().out
    result = json.loads(out.read_text())
    assert all(t[0] > 0 for t in result["per_round"].values())
    first = result["first_losses"]
    assert first["tsm"] == pytest.approx(first["plain"], rel=1e-6)  # the same model, data and updates
    assert result["state"] == [1.0] * 4  # the same parameters, gradients and AdamW state on every rank
