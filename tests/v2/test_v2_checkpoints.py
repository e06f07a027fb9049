"""SMP v2 checkpoints as AWS's checkpoints.py writes and reads them, on stock PyTorch (CPU, gloo).

Fidelity: a resumed job's losses equal the uninterrupted job's bit for bit at the same layout; a sharded
checkpoint loads exactly into another hybrid shard degree and trains on to the same losses (float noise).
"""

from __future__ import annotations

import pytest
import torch

from smp_compat.testing import run_ranks
from v2ckpt_jobs import Layout, job

STEPS, SAVE_AT = 5, 3


def _ranks(layout: Layout) -> int:
    return layout.rep * layout.shard * layout.tp


@pytest.mark.parametrize(
    "saved, resumed",
    [(Layout(2, 2), Layout(2, 2)), (Layout(1, 2, 2), Layout(1, 2, 2))],
    ids=["hsd2x2", "tp2xhsd2"],
)
def test_sharded_resume_is_bitwise(tmp_path, saved: Layout, resumed: Layout) -> None:
    folder = str(tmp_path / "llama-3steps")
    whole = run_ranks(job, _ranks(saved), "save", saved, folder, 0, SAVE_AT, STEPS, timeout=120)
    again = run_ranks(job, _ranks(resumed), "resume", resumed, folder, 7, SAVE_AT, STEPS, timeout=120)
    assert again[0]["done"] == SAVE_AT and again[0]["note"] == "v2ckpt"
    assert again[0]["losses"] == whole[0]["losses"][SAVE_AT:]


@pytest.mark.parametrize("resumed", [Layout(4, 1), Layout(1, 4)], ids=["to_hsd1", "to_hsd4"])
def test_sharded_checkpoint_resumes_at_another_hybrid_shard_degree(tmp_path, resumed: Layout) -> None:
    folder = str(tmp_path / "llama-3steps")
    whole = run_ranks(job, 4, "save", Layout(2, 2), folder, 0, SAVE_AT, STEPS, timeout=120)
    again = run_ranks(job, 4, "resume", resumed, folder, 7, SAVE_AT, STEPS, timeout=120)
    saved, loaded = whole[0]["saved"], again[0]["loaded"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert again[0]["losses"] == pytest.approx(whole[0]["losses"][SAVE_AT:], rel=1e-5)


@pytest.mark.parametrize("method", ["async_sharded", "async_local"])
def test_async_checkpoint_resume_is_bitwise(tmp_path, method: str) -> None:
    folder = str(tmp_path / "llama-3steps")
    whole = run_ranks(job, 4, "save", Layout(2, 2), folder, 0, SAVE_AT, STEPS, method, timeout=120)
    again = run_ranks(job, 4, "resume", Layout(2, 2), folder, 7, SAVE_AT, STEPS, method, timeout=120)
    saved, loaded = whole[0]["saved"], again[0]["loaded"]
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert again[0]["done"] == SAVE_AT and again[0]["note"] == "v2ckpt"
    assert again[0]["losses"] == whole[0]["losses"][SAVE_AT:]


@pytest.mark.hf
def test_local_checkpoint_loads_with_the_scripts_plain_torch_load_and_resumes_bitwise(tmp_path) -> None:
    from v2ckpt_local import local_job

    folder = str(tmp_path / "llama-3steps")
    whole = run_ranks(local_job, 4, "save", folder, SAVE_AT, STEPS, timeout=180)
    again = run_ranks(local_job, 4, "resume", folder, SAVE_AT, STEPS, timeout=180)
    assert again[0]["done"] == SAVE_AT and again[0]["config"] == "LlamaConfig"
    assert again[0]["losses"] == whole[0]["losses"][SAVE_AT:]
