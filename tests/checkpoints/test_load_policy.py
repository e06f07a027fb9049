"""Safe loading lets a job resume its own user_content: harmless types load, the rest when trusted (issue 10).

A script's argparse Namespace, numpy scalars/dtypes/arrays, paths and Hugging Face configs load by
default (test_data_only.py covers each data-only class); a script's own class in a file smp_compat did not
write for this user (no valid keyed digest, see test_signing.py) loads only when the folder is trusted,
through ``SMP_COMPAT_TRUST_CHECKPOINTS`` or ``smp-compat run --trust-checkpoint DIR`` (no script edit), or
with ``weights_only=False``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import smp_compat as smp
from smp_compat.cli.run import plan_launch
from smp_compat.errors import CheckpointError
from smp_compat.checkpoints.load_policy import TRUST_ENV, TRUST_FLAG, is_trusted

from opaque import Opaque

__all__: list[str] = []

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_dp.py"


def _script_content() -> dict[str, Any]:
    """What AWS-style scripts keep: their arguments, counters as numpy scalars, an RNG state, paths."""
    args = argparse.Namespace(lr=0.1, max_steps=np.int64(100), out=Path("/tmp/run"), layers=[1, 2])
    return {
        "args": args,
        "cli_args": dict(vars(args)),
        "loss": np.float32(2.5),
        "best": np.float64(1.25),
        "done": np.bool_(False),
        "dtype": np.dtype("float16"),
        "rng": np.random.RandomState(0).get_state(),
        "tags": frozenset({"a"}),
    }


def _assert_same(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert vars(loaded["args"]) == vars(saved["args"]) and isinstance(loaded["args"], argparse.Namespace)
    assert loaded["cli_args"] == saved["cli_args"]
    for key in ("loss", "best", "done", "dtype", "tags"):
        assert loaded[key] == saved[key] and type(loaded[key]) is type(saved[key]), key
    assert loaded["rng"][0] == saved["rng"][0] and np.array_equal(loaded["rng"][1], saved["rng"][1])


def _model() -> Any:
    torch.manual_seed(0)
    return smp.DistributedModel(nn.Linear(3, 2))


def _save_config_checkpoint(root: Path) -> None:
    """A checkpoint as if from elsewhere: its keyed digests removed (a job's own loads in full: test_signing)."""
    smp.init({})
    smp.save_checkpoint(root, "gpt2", model=_model(), user_content={"model_config": Opaque("gpt2"), "step": 3})
    _unsign(root)


def _unsign(root: Path) -> None:
    for digest in root.rglob("*.hmac"):
        digest.unlink()


def _assert_config(content: Any) -> None:
    assert content["model_config"] == Opaque("gpt2") and content["step"] == 3


# ---------------------------------------------------------------- harmless types load by default


def test_resume_loads_namespace_numpy_and_paths_by_default(tmp_path: Path) -> None:
    smp.init({})
    saved = _script_content()
    smp.save_checkpoint(tmp_path, "a", model=_model(), user_content=saved)
    _assert_same(smp.resume_from_checkpoint(tmp_path), saved)


def test_full_resume_loads_them_too(tmp_path: Path) -> None:
    smp.init({})
    saved = _script_content()
    smp.save_checkpoint(tmp_path, "full", partial=False, model=_model(), user_content=saved)
    _assert_same(smp.resume_from_checkpoint(tmp_path, "full", partial=False), saved)


def test_smp_load_loads_them_by_default(tmp_path: Path) -> None:
    smp.init({})
    saved = _script_content()
    smp.save(saved, tmp_path / "state.pt")
    _assert_same(smp.load(tmp_path / "state.pt"), saved)
    smp.save(saved, tmp_path / "full.pt", partial=False)
    _assert_same(smp.load(tmp_path / "full.pt", partial=False), saved)


def test_the_users_own_allow_list_is_left_as_it_was(tmp_path: Path) -> None:
    smp.init({})
    smp.save({"x": np.float64(1.0)}, tmp_path / "s.pt")
    before = set(torch.serialization.get_safe_globals())
    smp.load(tmp_path / "s.pt")
    assert set(torch.serialization.get_safe_globals()) == before
    with pytest.raises(Exception, match="numpy"):  # plain torch.load outside ours still refuses numpy
        torch.load(tmp_path / "s.pt_0_0.pt", weights_only=True)


# ---------------------------------------------------------------- anything else: trusted folders only


def test_a_class_of_the_scripts_own_is_refused_naming_every_way_out(tmp_path: Path) -> None:
    _save_config_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as info:
        smp.resume_from_checkpoint(tmp_path)
    message = str(info.value)
    assert "Opaque" in message
    assert f"{TRUST_ENV}={tmp_path}" in message
    assert f"smp-compat run {TRUST_FLAG} {tmp_path}" in message
    assert "weights_only=False" in message


@pytest.mark.parametrize("value", ["folder", "parent", "1"])
def test_the_environment_variable_trusts_a_folder_or_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    root = tmp_path / "ckpts"
    _save_config_checkpoint(root)
    trusted = {"folder": str(root), "parent": f"/nonexistent{os.pathsep}{tmp_path}", "1": "1"}[value]
    monkeypatch.setenv(TRUST_ENV, trusted)
    _assert_config(smp.resume_from_checkpoint(root))


def test_another_trusted_folder_does_not_trust_this_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpts"
    _save_config_checkpoint(root)
    (tmp_path / "other").mkdir()
    monkeypatch.setenv(TRUST_ENV, str(tmp_path / "other"))
    with pytest.raises(CheckpointError, match=TRUST_ENV):
        smp.resume_from_checkpoint(root)
    assert not is_trusted(root / "x", {TRUST_ENV: str(tmp_path / "ck")})  # a prefix of a name is not a parent
    assert not is_trusted(root / "x", {TRUST_ENV: "0"}) and is_trusted(root / "x", {TRUST_ENV: "true"})


def test_the_run_flag_exports_the_variable_and_is_not_passed_to_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_config_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path.parent)
    plan = plan_launch([TRUST_FLAG, tmp_path.name, f"{TRUST_FLAG}=/elsewhere", str(SCRIPT), "--lr", "1"],
                           environ={TRUST_ENV: "/inherited"})  # fmt: skip
    assert plan.env_updates[TRUST_ENV] == os.pathsep.join(["/inherited", str(tmp_path), "/elsewhere"])
    assert not any(token.startswith(TRUST_FLAG) for token in plan.command)
    assert plan.command[-3:] == [str(SCRIPT), "--lr", "1"]
    monkeypatch.setenv(TRUST_ENV, plan.env_updates[TRUST_ENV])
    _assert_config(smp.resume_from_checkpoint(tmp_path))


def test_weights_only_false_still_works(tmp_path: Path) -> None:
    _save_config_checkpoint(tmp_path)
    _assert_config(smp.resume_from_checkpoint(tmp_path, weights_only=False))


def test_smp_load_refuses_and_trusts_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smp.init({})
    smp.save({"model_config": Opaque("gpt2"), "step": 3}, tmp_path / "cfg.pt")
    _unsign(tmp_path)
    with pytest.raises(CheckpointError) as info:
        smp.load(tmp_path / "cfg.pt")
    message = str(info.value)
    assert "Opaque" in message and f"{TRUST_ENV}={tmp_path}" in message
    assert f"{TRUST_FLAG} {tmp_path}" in message and "weights_only=False" in message
    plan = plan_launch([TRUST_FLAG, str(tmp_path), str(SCRIPT)], environ={})
    monkeypatch.setenv(TRUST_ENV, plan.env_updates[TRUST_ENV])
    _assert_config(smp.load(tmp_path / "cfg.pt"))
    monkeypatch.setenv(TRUST_ENV, "1")
    _assert_config(smp.load(tmp_path / "cfg.pt"))
