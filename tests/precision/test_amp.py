"""smp.amp.GradScaler and autocast in the step body, across pipeline stages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.testing import run_ranks

STEPS, BATCH, MICROBATCHES = 3, 8, 2


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def _reference(dp: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: the same microbatches (of every data-parallel shard) under the same autocast."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for x, y in _data():
        opt.zero_grad()
        total = 0.0
        chunks = MICROBATCHES * dp
        for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(xm).float(), ym)
            scaler.scale(loss / chunks).backward()
            total += loss.item() / chunks
        scaler.step(opt)
        scaler.update()
        losses.append(total)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(inject_overflow_at: int | None, dp: int = 1) -> dict:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0, "ddp": dp > 1})  # fmt: skip
    net = _mlp()
    model = smp.DistributedModel(net)
    smp.set_partition(net[2], 1)
    smp.set_partition(net[4], 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler()
    step_index = [0]
    if smp.pp_rank() == 1:  # an overflow in one stage's own parameter gradient only
        net[4].weight.register_hook(lambda g: g * float("inf") if step_index[0] == inject_overflow_at else g)

    @smp.step
    def train_step(model, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x).float(), y)
        model.backward(scaler.scale(loss))
        return loss

    losses, scales, snapshots = [], [], []
    per_rank = BATCH // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    for x, y in _data():
        opt.zero_grad()
        local = train_step(model, x[lo : lo + per_rank], y[lo : lo + per_rank]).reduce_mean().item()
        losses.append(sum(smp.allgather(local, smp.DP_GROUP)) / smp.dp_size())
        before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        snapshots.append(all(torch.equal(before[n], p) for n, p in model.local_named_parameters()))
        step_index[0] += 1
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"losses": losses, "params": params, "scales": scales, "unchanged": snapshots}


@pytest.mark.parametrize("dp", [1, 2])
def test_autocast_in_step_body_with_grad_scaler_matches_plain_pytorch(dp: int) -> None:
    results = run_ranks(_train, 2 * dp, None, dp, timeout=90)
    ref_losses, ref_params = _reference(dp)
    merged = {k: v for r in results for k, v in r["params"].items()}
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=1e-2, atol=1e-3)
    for name, value in ref_params.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-2, atol=1e-3, msg=lambda m: f"{name}: {m}")


def test_overflow_on_one_stage_skips_the_step_on_every_stage() -> None:
    rank0, rank1 = run_ranks(_train, 2, 1, timeout=60)
    for r in (rank0, rank1):
        assert r["unchanged"] == [False, True, False]  # step 1 skipped everywhere
        assert r["scales"][1] == r["scales"][0] / 2  # and the scale halved everywhere
    assert rank0["scales"] == rank1["scales"]
