"""An SMP-style GPT-2 script, unmodified, through `smp-compat run` on 4 CPU processes (pp = 2 x dp = 2):
fp16 + sharded optimizer state + activation checkpointing + manual partition trains (the loss falls, the
optimizer steps), agrees with the same run without optimizer-state sharding, and a run resumed from the
partial checkpoint it saved mid-way (user_content as AWS's script stores it) ends bitwise where it ended;
the resumed run is in a fresh container (empty home, no checkpoint key, no trust flag: issue 33).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import launching
from launching import ROOT, clean_env, free_port, fresh_container_env, run_all, smp_compat_command

SCRIPT = ROOT / "tests" / "fixtures" / "smp_scripts" / "gpt2_pp_fp16.py"
STEPS, SAVE_AT = 6, 3


def _run(tmp_path: Path, name: str, *script_args: str, fresh: bool = False) -> dict[int, dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           str(SCRIPT), "--out", str(out), "--max_steps", str(STEPS), *script_args]  # fmt: skip
    run_all([(cmd, fresh_container_env(tmp_path / f"home-{name}") if fresh else clean_env())], tmp_path)
    return {int(p.stem[4:]): torch.load(p) for p in out.glob("rank*.pt")}


def _losses(results: dict[int, dict[str, Any]]) -> dict[int, float]:
    return results[0]["losses"]


def _assert_same_state(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], exact: bool) -> None:
    assert a.keys() == b.keys()
    for rank in a:
        assert a[rank]["state"].keys() == b[rank]["state"].keys()
        for name, value in a[rank]["state"].items():
            if exact:
                assert torch.equal(value, b[rank]["state"][name]), f"rank {rank} {name} differs"
            else:
                torch.testing.assert_close(value, b[rank]["state"][name], rtol=2e-2, atol=2e-3,
                                           msg=lambda m: f"rank {rank} {name}: {m}")  # fmt: skip


@pytest.mark.slow
def test_gpt2_fp16_sharded_pp2_dp2_trains_and_resumes_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launching, "TIMEOUT_S", 240)  # three 4-process jobs; ~20 s each on an idle 2-core machine
    ckpt = tmp_path / "ckpt"
    full = _run(tmp_path, "full", "--checkpoint_dir", str(ckpt), "--save_steps", str(SAVE_AT))  # saving mid-run
    losses = _losses(full)
    assert not any(r["overflow"] for r in full.values())
    _assert_replicas_identical(full)
    assert sum(losses[s] for s in (STEPS - 2, STEPS - 1)) / 2 < losses[0] - 0.05, losses

    unsharded = _run(tmp_path, "unsharded", "--checkpoint_dir", str(ckpt / "unused"), "--shard_optimizer_state", "0")
    torch.testing.assert_close(torch.tensor(list(_losses(unsharded).values())), torch.tensor(list(losses.values())),
                               rtol=2e-3, atol=2e-3)  # fmt: skip
    _assert_same_state(unsharded, full, exact=False)

    resumed = _run(tmp_path, "resumed", "--checkpoint_dir", str(ckpt), "--load_partial", "1", fresh=True)
    assert _losses(resumed) == {s: losses[s] for s in range(SAVE_AT, STEPS)}
    _assert_same_state(resumed, full, exact=True)
    assert (ckpt / "newest").read_text().split() == [f"step{SAVE_AT}_partial"]


def _assert_replicas_identical(results: dict[int, dict[str, Any]]) -> None:
    """Ranks holding the same pipeline stage (same parameter names) are data-parallel replicas: equal bitwise."""
    by_stage: dict[tuple[str, ...], list[dict[str, torch.Tensor]]] = {}
    for r in results.values():
        by_stage.setdefault(tuple(sorted(r["state"])), []).append(r["state"])
    assert len(by_stage) == 2 and all(len(v) == 2 for v in by_stage.values())
    for first, second in by_stage.values():
        assert all(torch.equal(first[n], second[n]) for n in first)
