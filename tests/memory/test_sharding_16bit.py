"""fp16/bf16 with shard_optimizer_state (issue 10, item 1): the sharded run is the unsharded run.

Sharding changes only where optimizer state lives, so every parameter, loss, overflow decision and
``clip_master_grads`` norm must equal the unsharded 16-bit run's, on every data-parallel replica. Before
the fix the owners broadcast their 16-bit weights before the fp32 masters were copied into them (bf16
replicas drifted apart), the non-owned 16-bit gradients were never cleared (fp16 overflowed forever at
SMP's default scale), and ``clip_master_grads`` used this rank's share's norm only.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from models import lm_train_step, make_batches, make_model, place_blocks_by_stage, train_smp
from smp_compat.testing import run_ranks

GLOBAL_BATCH = 8


def _train(pp: int, key: str, shard: bool, steps: int, clip: float | None, init_scale: float | None) -> dict:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "ddp": True, "shard_optimizer_state": shard,
              key: True, "auto_partition": False, "default_partition": 0,
              "deterministic_server": True})  # fmt: skip  # bitwise-repeatable 16-bit accumulation at pp > 1
    with smp.model_creation(dtype=torch.float16 if key == "fp16" else torch.bfloat16):
        net = make_model()
    model = smp.DistributedModel(net)
    if pp > 1:
        place_blocks_by_stage(smp, model)
    scale = {"dynamic_loss_scale": True} if key == "fp16" else {}  # SMP's default initial scale is 2^32
    if init_scale is not None:
        scale["dynamic_loss_args"] = {"init_scale": init_scale}
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), **scale)
    if clip is not None:
        step, norms = opt.step, []
        opt.step = lambda: (norms.append(opt.clip_master_grads(clip)), step())  # type: ignore[method-assign]
    losses = train_smp(smp, model, opt, lm_train_step(smp), steps, GLOBAL_BATCH)
    return {"losses": losses, "overflow": opt.overflow, "norms": norms if clip is not None else [],
            "params": {n: p.detach().float().clone() for n, p in model.local_named_parameters()}}  # fmt: skip


def _by_name(results: list[dict]) -> dict[str, list[torch.Tensor]]:
    """Each parameter's value on every rank that holds it (its data-parallel replicas)."""
    out: dict[str, list[torch.Tensor]] = {}
    for r in results:
        for name, value in r["params"].items():
            out.setdefault(name, []).append(value)
    return out


@pytest.mark.parametrize(
    "pp, key, steps, init_scale",
    [
        (1, "bf16", 4, None),
        (2, "bf16", 4, None),
        (1, "fp16", 22, None),  # from SMP's 2^32 the first ~17 steps overflow and are skipped
        (2, "fp16", 9, 2.0**20),  # fewer skips at pp = 2 to keep CI short
    ],
)
def test_sharded_16bit_training_equals_unsharded(pp: int, key: str, steps: int, init_scale: float | None) -> None:
    clip = 0.5  # below the gradient norm, so a share-only norm would clip differently
    sharded = run_ranks(_train, 2 * pp, pp, key, True, steps, clip, init_scale, timeout=180)
    plain = run_ranks(_train, 2 * pp, pp, key, False, steps, clip, init_scale, timeout=180)
    assert not sharded[0]["overflow"], "the fp16 scaler never recovered: every step overflowed"
    assert sharded[0]["losses"] == plain[0]["losses"]
    for s, p in zip(sharded, plain):
        live = [n for n in s["norms"] if n >= 0]  # -1: a skipped (overflowed) step
        assert len(live) >= 3 and live[0] > clip
        torch.testing.assert_close(s["norms"], p["norms"], rtol=1e-6, atol=0)
    plain_params = _by_name(plain)
    for name, replicas in _by_name(sharded).items():
        assert len(replicas) == 2
        for value in replicas:  # data-parallel replicas identical, and equal to the unsharded run
            assert torch.equal(value, replicas[0]), f"{name}: replicas differ by {(value - replicas[0]).abs().max()}"
            assert torch.equal(value, plain_params[name][0]), f"{name}: sharded differs from unsharded"


def _always_overflowing(env_limit: str | None) -> dict:
    import os

    import smp_compat as smp

    if env_limit is not None:
        os.environ["SMP_SKIPPED_STEPS_WARN_AFTER"] = env_limit
    smp.init({"microbatches": 1, "fp16": True})
    with smp.model_creation(dtype=torch.float16):
        net = torch.nn.Linear(4, 4)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=2.0**40)

    @smp.step
    def train_step(model, x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("smp_compat").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(7):
            opt.zero_grad()
            train_step(model, torch.ones(2, 4))
            opt.step()
    return {"logs": [r.getMessage() for r in records if "overflow" in r.getMessage()],
            "warnings": [str(w.message) for w in caught if w.category.__name__ == "SkippedStepsWarning"],
            "overflow": opt.overflow}  # fmt: skip


def test_a_run_that_skips_every_step_says_so_once() -> None:
    result = run_ranks(_always_overflowing, 1, "3", timeout=60)[0]
    assert result["overflow"]
    assert len(result["logs"]) == 1 and "skipped" in result["logs"][0]
    assert len(result["warnings"]) == 1  # at the 3rd consecutive skip, not again at the 6th
    message = result["warnings"][0]
    assert "skipped all of the last 3 steps" in message and "NOT training" in message
    assert "static_loss_scale" in message and "SMP_SKIPPED_STEPS_WARN_AFTER" in message


def test_skipped_steps_warning_default_and_off_switch() -> None:
    from smp_compat.precision.skipped_steps import DEFAULT_WARN_AFTER

    assert 20 < DEFAULT_WARN_AFTER <= 100  # later than the ~17 skips a healthy fp16 run starts with
    result = run_ranks(_always_overflowing, 1, "0", timeout=60)[0]
    assert result["warnings"] == [] and len(result["logs"]) == 1


def _resumable(path: str, steps: range, save_after: int | None, resume: bool) -> dict:
    import smp_compat as smp

    smp.init({"microbatches": 2, "ddp": True, "shard_optimizer_state": True, "fp16": True})
    with smp.model_creation(dtype=torch.float16):
        net = make_model()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2.0**8})  # fmt: skip
    if resume:
        smp.resume_from_checkpoint(path)
    train_step, data, lo = lm_train_step(smp), make_batches(4, GLOBAL_BATCH), smp.dp_rank() * GLOBAL_BATCH // 2
    for i in steps:
        opt.zero_grad()
        x, y = data[i]
        train_step(model, x[lo : lo + GLOBAL_BATCH // 2], y[lo : lo + GLOBAL_BATCH // 2])
        opt.step()
        if save_after == i:
            smp.save_checkpoint(path, tag=f"step{i}", model=model, optimizer=opt)
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "masters": opt.local_fp16_state_dict()["fp32_master_params"]}  # fmt: skip


def test_sharded_fp16_resume_is_bitwise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each data-parallel rank's fp32 masters are its own share, so each rank saves them (not rdp rank 0 only)."""
    straight = run_ranks(_resumable, 2, str(tmp_path / "a"), range(4), None, False, timeout=120)
    run_ranks(_resumable, 2, str(tmp_path / "b"), range(2), 1, False, timeout=120)
    resumed = run_ranks(_resumable, 2, str(tmp_path / "b"), range(2, 4), None, True, timeout=120)
    assert (tmp_path / "b" / "step1_partial" / "fp16_states_0_0_1.pt").is_file()
    for a, b in zip(straight, resumed):
        assert a["masters"].keys() == b["masters"].keys() and a["masters"]
        for key in ("params", "masters"):
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (key, name)
