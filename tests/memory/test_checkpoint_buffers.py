"""Activation checkpointing leaves module buffers as one forward would: BatchNorm statistics match plain PyTorch.

The recomputation in backward runs the forward again; without a guard BatchNorm updated its running
statistics twice per microbatch (torch's own ``checkpoint`` still does), so training matched but
evaluation silently did not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from smp_compat.memory.recompute_buffers import buffer_guard
from smp_compat.testing import run_ranks

STEPS, BATCH, MICROBATCHES, LR = 3, 16, 2, 0.1
STAGE_1 = (2, 3, 4)  # indices of _net() placed on pp_rank 1
TIMEOUT = 90


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    return nn.Sequential(nn.Linear(4, 8), block, nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 1))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]


def _reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch, no checkpointing, the same microbatches one after the other."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for x, y in _data():
        opt.zero_grad()
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            (F.mse_loss(net(xm), ym) / MICROBATCHES).backward()
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _train(how: str, pp: int) -> dict[str, torch.Tensor]:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    net = _net()
    if pp > 1:
        for index in STAGE_1:
            smp.set_partition(net[index], 1)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    if how == "mark":  # every child of the block, and the BatchNorm that may live on rank 1
        smp.set_activation_checkpointing(net[1])
        smp.set_activation_checkpointing(net[3])
    elif how == "contiguous":
        smp.set_activation_checkpointing(net[1], strategy="contiguous")

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = smp.checkpoint(net[1], net[0](x))
        return net[4](smp.checkpoint(net[3], net[2](h)))  # net[3] is a remote call at pp = 2

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(forward(x) if how == "call" else model(x), y)
        model.backward(loss)
        return loss

    for x, y in _data():
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    local = {n for n, _ in model.local_named_parameters()} | {n for n, _ in model.local_named_buffers()}
    return {k: v.clone() for k, v in net.state_dict().items() if k in local}


def _check(results: list[dict[str, torch.Tensor]]) -> None:
    ref = _reference()
    merged = {k: v for r in results for k, v in r.items()}
    assert {k for k in ref if "running" in k or "num_batches" in k} <= set(merged)
    for name, value in merged.items():
        torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("how", ["mark", "contiguous", "call"])
def test_pp1_checkpointed_batchnorm_keeps_plain_statistics(how: str) -> None:
    _check(run_ranks(_train, 1, how, 1, timeout=TIMEOUT))


@pytest.mark.parametrize("how", ["mark", "call"])
def test_pp2_checkpointed_batchnorm_keeps_plain_statistics(how: str) -> None:
    _check(run_ranks(_train, 2, how, 2, timeout=TIMEOUT))


def test_guard_undoes_the_recomputation_only() -> None:
    """The guard alone, with torch's checkpoint: one update per forward, and gradients unchanged."""
    torch.manual_seed(0)
    bn, x = nn.BatchNorm1d(4), torch.randn(8, 4, requires_grad=True)
    plain = nn.BatchNorm1d(4)
    torch_checkpoint(bn, x, use_reentrant=False, context_fn=buffer_guard([bn])).square().sum().backward()
    grad, x.grad = x.grad, None
    plain(x).square().sum().backward()
    torch.testing.assert_close(grad, x.grad)
    for guarded, reference in zip(bn.buffers(), plain.buffers()):
        torch.testing.assert_close(guarded, reference)
    assert bn.num_batches_tracked.item() == 1
