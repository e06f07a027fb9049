"""Issue 33: a job's own checkpoints resume in a fresh container (new home, no key, nothing exported, no flag),
and at a smaller data-parallel world.

A restarted pod or spot instance has an empty home, so the checkpoint key the first attempt made is gone
and none of its digests verify. Its files hold only data (weights, optimizer state, the script's
arguments, a Hugging Face config, numpy values, dates), so they must still load, and the resumed run must
end bitwise where the uninterrupted one ended: SMP v1 partial checkpoints, full checkpoints, and
``smp.save`` / ``smp.load``. The SMP v2 types (sharded, local, async_sharded, async_local) resume in a fresh
container in their own tests, tests/v2/test_v2_checkpoints.py: each resume there runs under another home
(``fresh_home.fresh_container``, as here); the local type's plain ``torch.load`` goes through
``load_policy.allow_harmless(path)``, the same allow-list.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

import smp_compat as smp
from fresh_home import fresh_container
from models import causal_mask, lm_loss, make_batches, make_model
from smp_compat.testing import run_ranks

__all__: list[str] = []

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # import torch._dynamo once, before forking

N_STEPS, K_STEPS, GLOBAL_BATCH = 4, 2, 8


def _content(step: int) -> dict[str, Any]:
    """What AWS's GPT-2 scripts keep in user_content, and a few more data-only values."""
    return {
        "step": step,
        "model_config": transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2),
        "args": argparse.Namespace(lr=1e-2, out=Path("/opt/ml/checkpoints")),
        "saved_at": datetime.datetime(2026, 11, 28, 20, 0, tzinfo=datetime.timezone.utc),
        "total_tokens": np.int64(step * GLOBAL_BATCH * 8),
        "rng": np.random.RandomState(step).get_state(),
    }


def _assert_content(loaded: dict[str, Any], step: int) -> None:
    saved = _content(step)
    assert isinstance(loaded["model_config"], transformers.GPT2Config)
    assert loaded["model_config"].to_dict() == saved["model_config"].to_dict()
    assert vars(loaded["args"]) == vars(saved["args"]) and loaded["saved_at"] == saved["saved_at"]
    assert loaded["step"] == step and loaded["total_tokens"] == saved["total_tokens"]
    assert np.array_equal(loaded["rng"][1], saved["rng"][1])


def _config(dp: int) -> dict[str, Any]:
    """One microbatch, manual partition: two identical runs agree bitwise (test_checkpoint_folders.py)."""
    cfg: dict[str, Any] = {"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False,
                           "default_partition": 0}  # fmt: skip
    return {**cfg, "ddp": True} if dp > 1 else cfg


def _build() -> tuple[Any, Any, Any]:
    model = smp.DistributedModel(make_model())
    for i, block in enumerate(model.module.blocks):
        smp.set_partition(block, 0 if i < 2 else 1)
    smp.set_partition(model.module.ln_f, 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    mask = causal_mask(8)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def _train(model: Any, opt: Any, train_step: Any, first: int, last: int) -> list[torch.Tensor]:
    per_rank = GLOBAL_BATCH // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    losses = []
    for x, y in make_batches(N_STEPS, GLOBAL_BATCH)[first:last]:
        opt.zero_grad()
        out = train_step(model, x[lo : lo + per_rank], y[lo : lo + per_rank])
        opt.step()
        losses.append(out.reduce_mean())
    return losses


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


def _first_attempt(directory: str, home: str, dp: int) -> dict[str, Any]:
    """The uninterrupted run: K steps, every kind of save, N - K more steps."""
    key = fresh_container(home)
    smp.init(_config(dp))
    model, opt, train_step = _build()
    losses = _train(model, opt, train_step, 0, K_STEPS)
    whole = {n: t.clone() for n, t in model.state_dict().items()}  # rank 0's gathered model, {} elsewhere
    at_save = _params(model)
    smp.save_checkpoint(directory, "partial", model=model, optimizer=opt, user_content=_content(K_STEPS))
    smp.save_checkpoint(directory, "full", partial=False, model=model, user_content=_content(K_STEPS))
    smp.save({"params": at_save, "content": _content(K_STEPS)}, os.path.join(directory, "state.pt"))
    smp.save({"content": _content(K_STEPS)}, os.path.join(directory, "whole.pt"), partial=False)
    losses += _train(model, opt, train_step, K_STEPS, N_STEPS)
    return {"losses": losses, "at_save": at_save, "whole": whole, "final": _params(model), "signed": key.is_file(),
            "pp_rank": smp.pp_rank()}  # fmt: skip


def _restarted(directory: str, home: str, dp: int) -> dict[str, Any]:
    """A fresh container: every save of the first attempt loads, and the partial one resumes the training.

    The full and the partial checkpoint hold the same weights (both saved after step K), so whichever of
    their delayed loads lands last, the model is the same; the optimizer state comes from the partial one.
    """
    key = fresh_container(home)
    smp.init(_config(dp))
    model, opt, train_step = _build()
    _assert_content(smp.resume_from_checkpoint(directory, tag="full", partial=False), K_STEPS)
    whole = smp.load(os.path.join(directory, "full"), partial=False)
    state = smp.load(os.path.join(directory, "state.pt"))
    _assert_content(state["content"], K_STEPS)
    _assert_content(smp.load(os.path.join(directory, "whole.pt"), partial=False)["content"], K_STEPS)
    content = smp.resume_from_checkpoint(directory, tag="partial")
    _assert_content(content, K_STEPS)
    losses = _train(model, opt, train_step, content["step"], N_STEPS)
    return {"losses": losses, "whole": whole, "state": state["params"], "final": _params(model),
            "key_made": key.exists()}  # fmt: skip


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_restart_in_a_fresh_container_resumes_bitwise_with_no_key_and_no_flag(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    first = run_ranks(_first_attempt, 2, directory, str(tmp_path / "home1"), 1, timeout=90)
    again = run_ranks(_restarted, 2, directory, str(tmp_path / "home2"), 1, timeout=90)
    for a, b in zip(first, again):
        assert a["signed"] and not b["key_made"]  # signed under a key the restart never had
        assert [x.item() for x in a["losses"][K_STEPS:]] == [x.item() for x in b["losses"]]
        _equal(a["final"], b["final"])
        _equal(a["at_save"], b["state"])
    _equal(first[0]["whole"], again[0]["whole"])  # the full checkpoint's model, as rank 0 gathered it
    assert first[0]["whole"] and not first[1]["whole"]


def _shrunk(directory: str, home: str) -> dict[str, Any]:
    """pp 2 x dp 1, resuming a pp 2 x dp 2 checkpoint: each rank now takes the whole global batch."""
    fresh_container(home)
    smp.init(_config(1))
    model, opt, train_step = _build()
    content = smp.resume_from_checkpoint(directory, tag="partial")
    losses = _train(model, opt, train_step, content["step"], N_STEPS)
    return {"losses": losses, "final": _params(model), "pp_rank": smp.pp_rank()}


def test_a_restart_at_a_smaller_data_parallel_world_ends_where_the_uninterrupted_run_ends(tmp_path: Path) -> None:
    """pp 2 x dp 2 -> pp 2 x dp 1: the same global batch, reduced over one replica instead of two, so the
    results agree to rounding (fp32, rtol 1e-5), not bitwise."""
    directory = str(tmp_path / "ckpt")
    first = run_ranks(_first_attempt, 4, directory, str(tmp_path / "home1"), 2, timeout=120)
    again = run_ranks(_shrunk, 2, directory, str(tmp_path / "home2"), timeout=90)
    for b in again:
        replicas = [r for r in first if r["pp_rank"] == b["pp_rank"]]
        a = replicas[0]
        global_losses = torch.stack([torch.stack(r["losses"][K_STEPS:]) for r in replicas]).mean(0)  # equal shards
        torch.testing.assert_close(torch.stack(b["losses"]), global_losses, rtol=1e-5, atol=1e-6)
        assert a["final"].keys() == b["final"].keys()
        for name in a["final"]:
            torch.testing.assert_close(b["final"][name], a["final"][name], rtol=1e-5, atol=1e-6, msg=name)
