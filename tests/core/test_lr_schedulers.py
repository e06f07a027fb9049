"""torch's LR schedulers on what ``smp.DistributedOptimizer`` returns, as SMP scripts and HF's Trainer use them.

A scheduler wraps ``optimizer.step`` by rebinding its ``__func__``; the patched step was a plain function,
so constructing any scheduler (LambdaLR, HF's ``get_linear_schedule_with_warmup``) raised AttributeError.
Each configuration trains against plain PyTorch with the same schedule.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.testing import run_ranks

STEPS, BATCH, LR = 4, 8, 0.1
TIMEOUT = 90


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 2, generator=g)) for _ in range(STEPS)]


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _reference() -> dict[str, torch.Tensor]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    for x, y in _data():
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        schedule.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _train(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    import smp_compat as smp

    smp.init({"microbatches": 2, "auto_partition": False, "default_partition": 0, **config})
    net = _net()
    if smp.pp_size() > 1:
        smp.set_partition(net[4], 1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    per_rank = BATCH // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    for x, y in _data():
        opt.zero_grad()
        train_step(model, x[lo : lo + per_rank], y[lo : lo + per_rank])
        opt.step()
        schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(LR)  # the warm-up ran to its end
    local = {n for n, _ in model.local_named_parameters()}
    return {k: v.clone() for k, v in net.state_dict().items() if k in local}


@pytest.mark.parametrize(
    ("config", "world"),
    [
        ({}, 1),
        ({"pipeline_parallel_degree": 2}, 2),
        ({"ddp": True, "shard_optimizer_state": True}, 2),
    ],
    ids=["pp1", "pp2", "dp2-sharded-optimizer"],
)
def test_lr_scheduler_on_the_distributed_optimizer_matches_plain_pytorch(config: dict[str, Any], world: int) -> None:
    ref = _reference()
    merged = {k: v for r in run_ranks(_train, world, config, timeout=TIMEOUT) for k, v in r.items()}
    assert set(merged) == {k for k in ref if "weight" in k or "bias" in k}
    for name, value in merged.items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
