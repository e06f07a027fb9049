"""Unmodified SMP scripts run without spurious warnings (issue 10, item 5); real problems still warn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp_compat.stepping.split as split_module
from smp_compat.stepping.split import split_step_inputs
from smp_compat.testing import run_ranks


@pytest.fixture(autouse=True)
def _fresh_warning_state() -> Iterator[None]:
    split_module._warned.clear()
    yield
    split_module._warned.clear()


def step(*args: Any) -> None:
    """Takes anything."""


@dataclasses.dataclass
class TrainConfig:
    lr: float = 0.1
    name: str = "run"


class LossFn:
    """A callable object that is not a module."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


class Batch:
    """Per-sample data in a class SMP cannot split."""

    def __init__(self) -> None:
        self.ids = torch.zeros(4, 3)


def test_objects_that_are_not_batch_data_pass_silently() -> None:
    from smp_compat.amp import GradScaler
    from smp_compat.config import SMPConfig

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    values = (
        GradScaler(device="cpu"), torch.amp.GradScaler("cpu"), optimizer,
        torch.optim.lr_scheduler.StepLR(optimizer, 1), model, SMPConfig(), TrainConfig(),
        argparse.Namespace(lr=1.0), LossFn(), object(), None, True, "text", {"lr": 0.1, "cfg": TrainConfig()},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = split_step_inputs(step, values, {}, 4)
    for args, _ in result:
        assert all(a is b for a, b in zip(args, values) if not isinstance(b, dict))


class OptimizerWrapper:
    """Like an fp16 optimizer wrapper: holds tensors (master weights), but is no batch data."""

    def __init__(self) -> None:
        self.masters = [torch.zeros(3)]

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...


def test_smp_fp16_optimizer_and_optimizer_wrappers_pass_silently() -> None:
    import smp_compat as smp

    smp.init({"fp16": True})
    with smp.model_creation(dtype=torch.float16):
        net = nn.Linear(2, 2)
    model = smp.DistributedModel(net)
    fp16_optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not isinstance(fp16_optimizer, torch.optim.Optimizer)  # the wrapper, as in SMP
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        split_step_inputs(step, (fp16_optimizer, OptimizerWrapper()), {}, 2)


@pytest.mark.parametrize("value", [np.zeros((4, 3)), Batch(), [torch.zeros(4), Batch()]], ids=["numpy", "batch", "list"])
def test_plausible_batch_data_that_cannot_be_split_still_warns(value: Any) -> None:
    with pytest.warns(UserWarning, match="cannot be split into microbatches"):
        split_step_inputs(step, (value,), {}, 2)


def test_a_dataloader_still_warns() -> None:
    with pytest.warns(UserWarning, match="Iterate the DataLoader"):
        split_step_inputs(step, (torch.utils.data.DataLoader(list(range(4))),), {}, 2)


def test_loss_scale_arguments_without_fp16_and_prescaled_batch_at_tp1_are_debug_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import smp_compat as smp

    caplog.set_level(logging.DEBUG, logger="smp_compat")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smp.init({"prescaled_batch": True})
        model = smp.DistributedModel(nn.Linear(2, 2))
        smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0,
                                 dynamic_loss_scale=True)  # fmt: skip
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("prescaled_batch" in m for m in debug)
    assert any("static_loss_scale" in m for m in debug)


def test_other_keys_not_acted_on_still_warn() -> None:
    import smp_compat as smp

    with pytest.warns(UserWarning, match=r"does not act on them yet: fp16_params\. See"):
        smp.init({"fp16_params": True, "skip_tracing": True, "prescaled_batch": True})  # the last two: inert at pp 1


# --- activation checkpointing of a Sequential whose parameter-free children run on their caller's rank ----


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


class Spanning(nn.Module):
    """Not a Sequential: its children live on two ranks, so it cannot be checkpointed as one piece."""

    def __init__(self, seq: nn.Sequential) -> None:
        super().__init__()
        self.seq = seq

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


def _checkpointed_pipeline(config: dict) -> dict:
    import smp_compat as smp

    smp.init(config)
    model = smp.DistributedModel(Spanning(_mlp()))
    seq = model.module.seq
    smp.set_partition(seq[2], 1)
    smp.set_partition(seq[4], 1)
    smp.set_activation_checkpointing(seq)  # "each": Tanh and ReLU have no parameters and span nothing
    smp.set_activation_checkpointing(model.module)  # really spans ranks: skipped with a warning
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _batches():
            opt.zero_grad()
            losses.append(train(model, x, y).reduce_mean().item())
            opt.step()
    return {
        "warnings": [str(w.message) for w in caught],
        "checkpointed": [bool(getattr(m, "_smp_checkpointed", False)) for m in seq],
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
    }


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(2)]


def test_parameter_free_children_of_a_checkpointed_sequential_are_checkpointed_without_a_spans_warning() -> None:
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}
    results = run_ranks(_checkpointed_pipeline, 2, config, timeout=90)
    for r in results:
        spans = [m for m in r["warnings"] if "spans pipeline ranks" in m]
        assert spans and all(m.startswith("Spanning spans pipeline ranks") for m in spans), r["warnings"]
        assert r["checkpointed"] == [True] * 5
    model, losses = _mlp(), []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    merged = {k: v for r in results for k, v in r["params"].items()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(merged[f"seq.{name}"], p.detach(), rtol=1e-5, atol=1e-6)
