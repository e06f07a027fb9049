"""shard_optimizer_state under tensor parallelism (issue 12, scope 6-7): tp = 2 x rdp = 2, pp = 1.

The optimizer state is split over the rdp group (the ranks holding the same shards); sharding changes only
where the state lives, so the run must equal the unsharded run (bitwise) and plain PyTorch (fp32, ~1e-5),
with about 1/rdp of the optimizer state per rank; fp16 clip norms and partial checkpoints included.
"""

from __future__ import annotations

import os

import pytest
import torch

import tp_models as tm
from smp_compat.testing import run_ranks

STEPS, LR, EPS = 4, 1e-2, 1e-4  # eps above the float noise of the key bias, whose true gradient is 0


def _adamw(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.01)


def _state_elements(opt) -> int:  # type: ignore[no-untyped-def]
    return sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())


def _train_fp32(prescaled: bool, shard: bool) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled, "shard_optimizer_state": shard})
    torch.manual_seed(0)
    model = smp.DistributedModel(tm.TinySmpLM(smp.nn))
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in tm.batches(STEPS):
        opt.zero_grad()
        losses.append(train_step(tm.my_samples(smp, ids)).reduce_mean().item())
        opt.step()
    return {"losses": losses, "state": _state_elements(opt), "tp": smp.tp_rank(), "rdp": smp.rdp_rank(),
            "local": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "full": {k: v.clone() for k, v in model.state_dict().items()}}  # fmt: skip


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, one process, the global batch, the same AdamW."""
    import smp_compat as smp

    torch.manual_seed(0)
    model = tm.TinySmpLM(smp.nn)
    opt = _adamw(model.parameters())
    losses = []
    for ids in tm.batches(STEPS):
        loss = tm.lm_loss(model(ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("prescaled", [False, True])
def test_sharded_adamw_equals_unsharded_and_plain_pytorch(prescaled: bool) -> None:
    sharded = run_ranks(_train_fp32, 4, prescaled, True, timeout=180)
    plain = run_ranks(_train_fp32, 4, prescaled, False, timeout=180)
    ref_losses, ref_params = _reference()
    mean_losses = torch.tensor([r["losses"] for r in sharded]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for s, p in zip(sharded, plain):
        assert s["losses"] == p["losses"]
        for name, value in s["local"].items():  # sharding moves optimizer state, nothing else
            assert torch.equal(value, p["local"][name]), f"{name}: sharded differs from unsharded"
        for name, value in ref_params.items():
            torch.testing.assert_close(s["full"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert 0.35 < s["state"] / p["state"] < 0.65, (s["state"], p["state"])  # about 1/rdp of Adam's moments
    for tp_rank in (0, 1):  # the rdp ranks' shares partition exactly what one unsharded rank holds
        mine = [s["state"] for s in sharded if s["tp"] == tp_rank]
        assert len(mine) == 2 and sum(mine) == plain[tp_rank]["state"]


def _train_fp16(shard: bool, clip: float, inf_at: int | None = None) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "fp16": True, "shard_optimizer_state": shard})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_adamw(model.parameters()), dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2.0**16})  # fmt: skip

    step_index = [0]
    if inf_at is not None and smp.tp_rank() == 1 and smp.rdp_rank() == 0:  # one rank's shard only
        net.proj.weight.register_hook(lambda g: g * float("inf") if step_index[0] == inf_at else g)

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    norms, losses = [], []
    for step_index[0], ids in enumerate(tm.batches(6)):
        opt.zero_grad()
        losses.append(train_step(tm.my_samples(smp, ids)).reduce_mean().item())
        norms.append(opt.clip_master_grads(clip))
        opt.step()
    return {"losses": losses, "norms": norms, "scale": opt.loss_scale, "tp": smp.tp_rank(),
            "local": {n: p.detach().clone() for n, p in model.local_named_parameters()}}  # fmt: skip


def test_sharded_fp16_equals_unsharded_bitwise_with_clipping() -> None:
    clip = 0.3  # below the gradient norm: a norm of the share only would clip differently
    sharded = run_ranks(_train_fp16, 4, True, clip, timeout=180)
    plain = run_ranks(_train_fp16, 4, False, clip, timeout=180)
    live = [n for n in plain[0]["norms"] if n >= 0]  # -1: an overflowed (skipped) step, agreed by all
    assert len(live) >= 3 and min(live) > clip and -1.0 in plain[0]["norms"]
    for s, p in zip(sharded, plain):
        assert s["norms"] == p["norms"] and s["losses"] == p["losses"] and s["scale"] == p["scale"]
        assert s["norms"] == plain[0]["norms"]  # one norm for the whole model, on every rank
        for name, value in s["local"].items():
            assert torch.equal(value, p["local"][name]), f"{name}: sharded differs from unsharded"


def test_an_overflow_in_one_tp_ranks_share_skips_the_step_everywhere() -> None:
    """Only the tp = 1 ranks see the inf, and only the owner of proj.weight's share finds it: all must skip."""
    results = run_ranks(_train_fp16, 4, True, 1e9, 4, timeout=90)  # a disagreement hangs
    for r in results:
        assert r["norms"][4] == -1.0 and r["norms"][3] > 0 and r["norms"][5] > 0, r["norms"]
        assert r["scale"] == results[0]["scale"]
    for tp_rank in (0, 1):  # the rdp replicas of each tp rank stay identical
        a, b = (r["local"] for r in results if r["tp"] == tp_rank)
        assert all(torch.equal(a[n], b[n]) for n in a)


def _resumable(path: str, steps: range, save_after: int | None, resume: bool) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "fp16": True, "shard_optimizer_state": True})
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.float16):
        net = tm.TinySmpLM(smp.nn)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_adamw(model.parameters()), dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2.0**8})  # fmt: skip
    if resume:
        smp.resume_from_checkpoint(path)

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    data = tm.batches(4)
    for i in steps:
        opt.zero_grad()
        train_step(tm.my_samples(smp, data[i]))
        opt.step()
        if save_after == i:
            smp.save_checkpoint(path, tag=f"step{i}", model=model, optimizer=opt)
            smp.save(opt.local_state_dict(), os.path.join(path, "opt.pt"), partial=True, v3=True)
            smp.barrier()  # smp.save writes this rank's part only; the load below checks every part exists
    loaded = smp.load(os.path.join(path, "opt.pt"), partial=True) if save_after is not None else None
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "masters": opt.local_fp16_state_dict()["fp32_master_params"],
            "v3_states": None if loaded is None else len(loaded["state"]), "states": len(opt.state)}  # fmt: skip


def test_partial_checkpoint_resume_continues_bitwise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    straight = run_ranks(_resumable, 4, str(tmp_path / "a"), range(4), None, False, timeout=180)
    saved = run_ranks(_resumable, 4, str(tmp_path / "b"), range(2), 1, False, timeout=180)
    resumed = run_ranks(_resumable, 4, str(tmp_path / "b"), range(2, 4), None, True, timeout=180)
    files = sorted(f for f in os.listdir(tmp_path / "b" / "step1_partial") if not f.endswith(".hmac"))
    both = [(t, r) for t in (0, 1) for r in (0, 1)]
    assert files == sorted(["smp_config.pt", "user_content.pt", "model_0_0.pt", "model_0_1.pt",
                            *(f"optimizer_states_0_{t}_{r}.pt" for t, r in both),
                            *(f"fp16_states_0_{t}_{r}.pt" for t, r in both)])  # fmt: skip
    assert sorted(f for f in os.listdir(tmp_path / "b") if f.startswith("opt.pt") and f.endswith(".pt")) == [
        f"opt.pt_0_{t}_{r}.pt" for t, r in both  # smp.save(partial=True, v3=True): {f}_{pp}_{tp}_{rdp}.pt
    ]
    for r in saved:
        assert r["v3_states"] == r["states"] > 0  # each rank's own share came back
    for a, b in zip(straight, resumed):
        assert a["masters"].keys() == b["masters"].keys() and a["masters"]
        for key in ("params", "masters"):
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (key, name)


def test_tp_with_shard_optimizer_state_is_accepted() -> None:
    from smp_compat.config.sources import resolve_config

    cfg = resolve_config({"tensor_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True}, environ={})
    assert cfg.shard_optimizer_state and cfg.tensor_parallel_degree == 2
