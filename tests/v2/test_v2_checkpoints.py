"""SMP v2 checkpoints as AWS's checkpoints.py writes and reads them, on stock PyTorch (CPU, gloo).

Fidelity: a resumed job's losses equal the uninterrupted job's bit for bit at the same layout; a sharded
checkpoint loads exactly into another hybrid shard degree and trains on to the same losses (float noise).

Every resume runs in a fresh container (issue 33): another home, no key variable, no trust variable, no flag, so
the saving job's key and digests are gone; what the checkpoint holds besides tensors (counters, the script's
arguments, its Hugging Face config) must load as data.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, inherited by every forked rank: see below)
import transformers  # noqa: F401

from smp_compat.testing import run_ranks
from v2ckpt_jobs import HIDDEN, WIDTH, Layout, job, user_content

STEPS, SAVE_AT = 5, 3
# Each rank's tsm.init() imports transformers and its optimizer torch._dynamo: imported above, before any fork,
# they are not imported again by every rank of every job (about 600 modules a rank; this file took 64-95 s
# without, 14-16 s with, at load 6-12).


def _resumed_in_a_fresh_container(again: dict) -> None:
    """The resume found its counters and the Hugging Face config, and never had a key to verify digests with."""
    assert again["done"] == SAVE_AT and again["note"] == "v2ckpt"
    assert again["config"] == user_content(SAVE_AT)["model_config"].to_dict() and not again["key_made"]


def test_sharded_resume_is_bitwise_and_reshards_to_other_hybrid_shard_degrees(tmp_path) -> None:
    """Saved at hybrid shard 2 x 2 replicas; resumed at the same layout (bitwise) and at hsd 1 and 4 (exact load)."""
    folder, saving, fresh = str(tmp_path / "llama-3steps"), str(tmp_path / "home1"), str(tmp_path / "home2")
    whole = run_ranks(job, 4, "save", Layout(2, 2), folder, saving, 0, SAVE_AT, STEPS, timeout=120)
    saved, expected = whole[0]["saved"], whole[0]["losses"][SAVE_AT:]
    for resumed in (Layout(2, 2), Layout(4, 1), Layout(1, 4)):
        again = run_ranks(job, 4, "resume", resumed, folder, fresh, 7, SAVE_AT, STEPS, timeout=120)[0]
        _resumed_in_a_fresh_container(again)
        loaded = again["loaded"]
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved), resumed
        if resumed == Layout(2, 2):
            assert again["losses"] == expected
        else:  # another reduction order: float noise only
            assert again["losses"] == pytest.approx(expected, rel=1e-5), resumed


def test_tp_sharded_checkpoint_is_one_complete_checkpoint_per_tp_folder_and_resumes_bitwise(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "llama-3steps"
    layout = Layout(1, 2, 2)
    whole = run_ranks(job, 4, "save", layout, str(folder), str(tmp_path / "home1"), 0, SAVE_AT, STEPS, timeout=120)
    assert sorted(p.name for p in folder.iterdir()) == ["tp2-0", "tp2-1"]
    meta = dcp.FileSystemReader(str(folder / "tp2-1")).read_metadata().state_dict_metadata
    assert tuple(meta["model.blocks.0.up.weight"].size) == (HIDDEN // 2, WIDTH)  # Colwise: this TP rank's rows
    assert tuple(meta["model.blocks.0.down.weight"].size) == (WIDTH, HIDDEN // 2)  # Rowwise: its columns
    assert tuple(meta["model.head.weight"].size) == (WIDTH, WIDTH)  # not tensor-parallel: whole
    again = run_ranks(job, 4, "resume", layout, str(folder), str(tmp_path / "home2"), 7, SAVE_AT, STEPS, timeout=120)
    _resumed_in_a_fresh_container(again[0])
    assert again[0]["losses"] == whole[0]["losses"][SAVE_AT:]
    assert all(torch.equal(whole[0]["saved"][k], again[0]["loaded"][k]) for k in whole[0]["saved"])


@pytest.mark.parametrize("method", ["async_sharded", "async_local"])
def test_async_checkpoint_resume_is_bitwise(tmp_path, method: str) -> None:
    folder, saving, fresh = str(tmp_path / "llama-3steps"), str(tmp_path / "home1"), str(tmp_path / "home2")
    whole = run_ranks(job, 4, "save", Layout(2, 2), folder, saving, 0, SAVE_AT, STEPS, method, timeout=120)
    again = run_ranks(job, 4, "resume", Layout(2, 2), folder, fresh, 7, SAVE_AT, STEPS, method, timeout=120)
    saved, loaded = whole[0]["saved"], again[0]["loaded"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    _resumed_in_a_fresh_container(again[0])
    assert again[0]["losses"] == whole[0]["losses"][SAVE_AT:]


@pytest.mark.hf
def test_local_checkpoint_loads_with_the_scripts_plain_torch_load_and_resumes_bitwise(tmp_path) -> None:
    from v2ckpt_local import local_job

    folder, saving, fresh = str(tmp_path / "llama-3steps"), str(tmp_path / "home1"), str(tmp_path / "home2")
    whole = run_ranks(local_job, 4, "save", folder, saving, SAVE_AT, STEPS, timeout=180)
    again = run_ranks(local_job, 4, "resume", folder, fresh, SAVE_AT, STEPS, timeout=180)
    assert whole[0]["signed"] and not again[0]["key_made"]  # signed under a key the fresh container never had
    assert again[0]["done"] == SAVE_AT and again[0]["config"] == "LlamaConfig"
    assert again[0]["losses"] == whole[0]["losses"][SAVE_AT:]
