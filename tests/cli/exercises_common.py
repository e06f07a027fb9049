"""Shared pieces of the registry exercises (tests/cli/test_support_e2e.py): a tiny model, data, plain-PyTorch oracle.

Every exercise runs inside a rank of a 4-process CPU world, calls ``smp.init`` with its own config and
checks what it used (against plain single-process PyTorch where it trains); the runner resets smp after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D, HIDDEN, STEPS, GLOBAL_BATCH = 4, 8, 3, 8
PP2_DP2 = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}

torch.optim.Adam([nn.Parameter(torch.zeros(1))])  # its first use imports torch._dynamo: once here, not per forked rank


class Out(nn.Module):
    """The last layer, with a constant buffer (so buffers travel through partitioning and state dicts)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, D)
        self.register_buffer("shift", torch.full((D,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.shift


class Net(nn.Module):
    """Three stages' worth of layers; ``partition_a`` puts ``a`` on a partition with ``smp.partition``;
    ``buffer=False`` leaves out the buffer (delayed initialization refuses modules without reset_parameters())."""

    def __init__(self, smp: Any = None, partition_a: int | None = None, buffer: bool = True) -> None:
        super().__init__()
        if partition_a is not None:
            with smp.partition(partition_a):
                self.a = nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh())
        else:
            self.a = nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.c = Out() if buffer else nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def make_net(seed: int = 0, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL_BATCH, D, generator=g), torch.randn(GLOBAL_BATCH, D, generator=g))
            for _ in range(steps)]  # fmt: skip


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.05) if kind == "adam" else torch.optim.SGD(params, lr=0.1)


def reference(steps: int = STEPS, optimizer: str = "sgd",
              net: Callable[[], nn.Module] = make_net) -> dict[str, torch.Tensor]:  # fmt: skip
    """Plain single-process PyTorch on the global batches: the parameters every run must end with."""
    model = net()
    opt = make_optimizer(optimizer, model.parameters())
    for x, y in batches(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def mse_step(smp: Any, scaler: Any = None) -> Any:
    """The ``@smp.step`` the exercises train with (optionally scaling the loss with an amp GradScaler)."""

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss) if scaler is not None else loss)
        return loss

    return train_step


def shard(smp: Any, t: torch.Tensor) -> torch.Tensor:
    """This data-parallel rank's slice of a global batch."""
    per = t.shape[0] // smp.dp_size()
    return t[smp.dp_rank() * per : (smp.dp_rank() + 1) * per]


def train(smp: Any, model: Any, opt: Any, steps: range | None = None, step: Any = None,
          scaler: Any = None) -> list[float]:  # fmt: skip
    """SMP-style loop over ``steps`` of the shared batches; returns the global mean losses."""
    step = step or mse_step(smp, scaler)
    data = batches(max(steps) + 1 if steps else STEPS)
    losses = []
    for i in steps if steps is not None else range(STEPS):
        x, y = data[i]
        opt.zero_grad()
        out = step(model, shard(smp, x), shard(smp, y))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size())
    return losses


def full_params(smp: Any, model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the model, gathered from the pipeline stages that own them."""
    local = {n: t.detach().float().clone() for n, t in [*model.local_named_parameters(), *model.local_named_buffers()]}
    merged: dict[str, torch.Tensor] = {}
    for part in smp.allgather(local, smp.PP_GROUP):
        merged.update(part)
    return merged


def assert_matches(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 1e-5,
                   atol: float = 1e-6) -> None:  # fmt: skip
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value.float(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def train_and_compare(smp: Any, cfg: dict[str, Any], optimizer: str = "sgd", rtol: float = 1e-5,
                      atol: float = 1e-6) -> tuple[Any, Any]:  # fmt: skip
    """init(cfg), wrap, train STEPS steps and match plain PyTorch; returns (model, optimizer)."""
    smp.init(cfg)
    model = smp.DistributedModel(make_net())
    opt = smp.DistributedOptimizer(make_optimizer(optimizer, model.parameters()))
    train(smp, model, opt)
    assert_matches(full_params(smp, model), reference(optimizer=optimizer), rtol, atol)
    return model, opt
