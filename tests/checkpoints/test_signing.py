"""A job's own checkpoints load in full with no flag; a file changed since, or signed under another key, does not.

Each file smp_compat saves gets ``<file>.hmac``, its HMAC-SHA256 under a per-user key (conftest points
the key at a temporary folder). The refusals keep the message of test_load_policy.py.
"""

from __future__ import annotations

import argparse
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from torch import nn

import smp_compat as smp
from smp_compat.checkpoints import signing
from smp_compat.checkpoints.load_policy import TRUST_ENV
from smp_compat.checkpoints.signing import KEY_ENV, key_path
from smp_compat.errors import CheckpointError

from opaque import Opaque


def _content() -> dict[str, Any]:
    """What AWS's GPT-2 script keeps: its arguments, a Hugging Face config, numpy integers."""
    return {
        "cli_args": vars(argparse.Namespace(lr=0.1, seed=np.int64(7))),
        "model_config": transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2),  # data only: loads unsigned
        "sampler": Opaque("sampler"),  # not data: loads only when signed (or trusted)
        "total_steps": np.int64(12),
        "start_batch_index": np.int32(3),
    }


def _save(root: Path) -> Path:
    """A partial checkpoint of a world of one; returns its user_content file."""
    smp.init({})
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Linear(3, 2))
    smp.save_checkpoint(root, "s1", model=model, user_content=_content())
    return root / "s1_partial" / "user_content.pt"


def _assert_refused(root: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        smp.resume_from_checkpoint(root)
    assert "Opaque" in str(info.value) and f"{TRUST_ENV}={root}" in str(info.value)


def test_the_jobs_own_checkpoint_loads_in_full_with_no_flag(tmp_path: Path) -> None:
    user_content = _save(tmp_path)
    loaded = smp.resume_from_checkpoint(tmp_path)
    assert isinstance(loaded["model_config"], transformers.GPT2Config) and loaded["model_config"].n_layer == 2
    assert loaded["total_steps"] == 12 and type(loaded["total_steps"]) is np.int64
    assert loaded["cli_args"]["seed"] == 7 and loaded["sampler"] == Opaque("sampler")
    assert signing.digest_path(user_content).is_file()
    assert (tmp_path / "s1_partial" / "model_0_0.pt.hmac").is_file()  # every file has its digest


def test_smp_save_and_full_checkpoints_are_signed_too(tmp_path: Path) -> None:
    smp.init({})
    smp.save(_content(), tmp_path / "state.pt")
    assert smp.load(tmp_path / "state.pt")["total_steps"] == 12
    model = smp.DistributedModel(nn.Linear(3, 2))
    smp.save_checkpoint(tmp_path, "full", partial=False, model=model, user_content=_content())
    assert smp.resume_from_checkpoint(tmp_path, tag="full", partial=False)["total_steps"] == 12


def test_a_file_changed_since_is_refused(tmp_path: Path) -> None:
    """Same name, other bytes (a valid file, so it is the digest that refuses it, not damage)."""
    user_content = _save(tmp_path)
    torch.save({**_content(), "total_steps": np.int64(99)}, user_content)
    _assert_refused(tmp_path)


def test_a_file_without_its_digest_is_refused(tmp_path: Path) -> None:
    signing.digest_path(_save(tmp_path)).unlink()
    _assert_refused(tmp_path)


def test_a_file_signed_under_another_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "alice.key"))
    _save(tmp_path / "ck")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "bob.key"))
    smp.save({"x": 1}, tmp_path / "bob.pt", partial=False)  # bob has a key of his own
    _assert_refused(tmp_path / "ck")
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "alice.key"))
    assert smp.resume_from_checkpoint(tmp_path / "ck")["total_steps"] == 12


def test_no_key_verifies_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user_content = _save(tmp_path)
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "absent.key"))
    assert not signing.verifies(user_content, user_content.read_bytes())
    assert not (tmp_path / "absent.key").exists()  # loading creates no key


def test_the_key_is_made_once_private_in_the_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    path = key_path()
    assert path == tmp_path / "config" / "smp_compat" / "checkpoint.key"
    first = signing.user_key()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(first) == 32
    assert signing.user_key() == first and list(path.parent.iterdir()) == [path]  # kept, no temporary left


def test_a_key_others_can_read_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, str(tmp_path / "k"))
    signing.user_key()
    (tmp_path / "k").chmod(0o644)
    with pytest.raises(CheckpointError, match="chmod 600"):
        signing.user_key()
