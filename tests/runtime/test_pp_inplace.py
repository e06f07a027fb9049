"""In-place operations around pipeline boundaries, on 2 CPU ranks, each checked against plain PyTorch.

A stage whose first op is in place on the tensor it received (``nn.ReLU(inplace=True)``), and rank 0
changing in place a result that stayed on its owner, then handing it back (the owner's copy is then
out of date and must not be used).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp_compat as smp
from smp_compat.testing import run_ranks

D_IN, D, D_OUT, BATCH, LR, STEPS = 6, 8, 3, 8, 0.1, 4
TIMEOUT = 60


class ReluFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(self.act(h))


class InplaceFirstStage(nn.Module):
    """Rank 1's stage starts with an in-place ReLU on what it received; so does rank 0's tail (0 -> 1 -> 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.mid = ReluFirst()
        self.tail = ReluFirst()
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.out(self.tail(self.mid(self.inp(x))))


class LateInplace(nn.Module):
    """``a``'s result only passes back to rank 1 (so it stays there) until rank 0 changes it in place."""

    def __init__(self, change: str) -> None:
        super().__init__()
        self.change = change
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.a = nn.Linear(D, D)
            self.b = nn.Linear(D, D)
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.a(torch.tanh(self.inp(x)))
        if step >= 2 and self.change == "mul_":
            h.mul_(2.0)
        elif step >= 2 and self.change == "setitem":
            h[:, 0] = 0.0
        return self.out(torch.tanh(self.b(h)))


def _make(case: str) -> nn.Module:
    torch.manual_seed(0)
    return InplaceFirstStage() if case == "relu_first" else LateInplace(case)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)) for _ in range(STEPS)]


def _train_ranks(case: str, pipeline: str) -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": pipeline, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    model = smp.DistributedModel(_make(case))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step(non_split_inputs=["step"])
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        loss = F.mse_loss(model(x, step), y)
        model.backward(loss)
        return loss

    losses = []
    for step, (x, y) in enumerate(_data()):
        optimizer.zero_grad()
        losses.append(train_step(model, x, y, step).reduce_mean().item())
        optimizer.step()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.local_named_parameters()}}


def _reference(case: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _make(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, (x, y) in enumerate(_data()):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x, step), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("case", "pipeline"), [("relu_first", "interleaved"), ("relu_first", "simple"),
                                                ("mul_", "interleaved"), ("setitem", "interleaved")])  # fmt: skip
def test_in_place_changes_at_a_boundary_train_like_plain_pytorch(case: str, pipeline: str) -> None:
    results = run_ranks(_train_ranks, 2, case, pipeline, timeout=TIMEOUT)
    ref_losses, ref_params = _reference(case)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        merged.update(r["params"])
    assert merged.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
