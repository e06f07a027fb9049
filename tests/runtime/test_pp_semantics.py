"""Pipeline edge cases on 2 CPU ranks: what real models do inside forward, each checked against plain PyTorch.

Keyword arguments, dict/tuple/dataclass outputs crossing ranks, a loss computed inside the model, a module
called twice, eval under ``torch.no_grad()`` and ``model.eval()``, steps without backward, an input only a
later rank uses, identical StepOutputs on every rank, calls outside a step, placement by ``smp.partition``
contexts, and a rank 0 -> 1 -> 0 split with both pipeline schedules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp_compat as smp
from smp_compat.errors import FwdExecutionNotInStepFnError
from smp_compat.testing import run_ranks

D_IN, D, D_OUT = 6, 8, 3
STEPS, BATCH, LR = 2, 8, 0.1
TIMEOUT = 60


# ---------------------------------------------------------------------- models (placed by smp.partition)
# smp.partition does nothing before smp.init, so the plain-PyTorch reference builds the same modules.


class Scaled(nn.Module):
    """Takes keyword-only arguments: a tensor and a float."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, *, scale: float, shift: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.tanh(self.lin(h)) * scale
        return out if shift is None else out + shift


class KwargModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.mid = Scaled()
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, shift: torch.Tensor | None = None) -> torch.Tensor:
        return self.out(self.mid(torch.tanh(self.inp(x)), scale=scale, shift=shift))


@dataclass
class PlainOut:
    """A plain dataclass (not a container torch or smp know)."""

    pred: torch.Tensor
    aux: torch.Tensor


@dataclass
class ModelOutput(OrderedDict):
    """Shaped like Hugging Face's ModelOutput: a dataclass that is also an ordered dict of its fields."""

    pred: torch.Tensor | None = None
    aux: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) is not None:
                super().__setitem__(f.name, getattr(self, f.name))

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)


class TwoHeads(nn.Module):
    """Returns its two results as a dict, a tuple, a plain dataclass or a ModelOutput."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.pred = nn.Linear(D, D_OUT)
        self.aux = nn.Linear(D, 2)

    def forward(self, h: torch.Tensor) -> Any:
        pred, aux = self.pred(h), self.aux(h)
        if self.kind == "dict":
            return {"pred": pred, "aux": aux}
        if self.kind == "tuple":
            return pred, aux
        if self.kind == "dataclass":
            return PlainOut(pred, aux)
        return ModelOutput(pred=pred, aux=aux)


class StructuredModel(nn.Module):
    """The remote module's structured output is returned by the model as it is."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.heads = TwoHeads(kind)

    def forward(self, x: torch.Tensor) -> Any:
        return self.heads(torch.tanh(self.inp(x)))


def _pred_aux(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(out, tuple):
        return out
    if isinstance(out, dict):
        return out["pred"], out["aux"]
    return out.pred, out.aux


class LossHead(nn.Module):
    """Computes the loss itself (like HF models given labels) on the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D_OUT)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(h), labels)


class LossInsideModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.head = LossHead()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)), labels=labels)


class ReuseModel(nn.Module):
    """One module on rank 1 called twice per forward, with rank-0 work between (weight sharing by reuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.between = nn.Linear(D, D)
        with smp.partition(1):
            self.shared = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(torch.tanh(self.inp(x)))
        h = self.shared(torch.tanh(self.between(h)))
        return self.out(h)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * torch.sigmoid(gate)


class LateInputModel(nn.Module):
    """``gate`` is a step input that only the module on rank 1 uses; rank 0 just passes it on."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.gate = Gate()
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(torch.tanh(self.inp(x)), gate))


class DropoutModel(nn.Module):
    """Dropout on both ranks: model.eval() must switch it off where each module runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(D_IN, D), nn.Dropout(0.5))
        with smp.partition(1):
            self.mid = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Dropout(0.5))
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x)))


class SandwichModel(nn.Module):
    """rank 0 -> rank 1 -> rank 0 -> rank 1 -> rank 0 (non-contiguous stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.b = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        self.c = nn.Linear(D, D)
        with smp.partition(1):
            self.d = nn.Linear(D, D)
        self.e = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        h = self.d(torch.tanh(self.c(h)))
        return self.e(torch.tanh(h))


class CallbackInner(nn.Module):
    """On rank 1 (it has a parameter of its own), calling ``l0`` on rank 0: a 0 -> 1 -> 0 call chain."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((D,), 1.1))
        self.l = nn.Linear(D, D)
        with smp.partition(0):
            self.l0 = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l0(torch.tanh(self.l(h)))) * self.gain


class CallbackModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.inner = CallbackInner()
        self.out = nn.Linear(D, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(torch.tanh(self.a(x))))


class NestedPlacement(nn.Module):
    """Nested smp.partition blocks (the innermost wins) and a module left to default_partition."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D_IN, D)
        with smp.partition(1):
            self.b = nn.Linear(D, D)
            with smp.partition(0):
                self.c = nn.Linear(D, D)
            self.d = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.e = nn.Linear(D, D_OUT)  # moved to rank 1 by smp.set_partition after wrapping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.e(self.d(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


# ---------------------------------------------------------------------- cases: model + loss
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _structured_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    pred, aux = _pred_aux(model(x))
    return F.mse_loss(pred, y) + 0.1 * aux.pow(2).mean()


def _plain_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


CASES: dict[str, tuple[Callable[[], nn.Module], Loss]] = {
    "kwargs": (KwargModel, lambda m, x, y, e: F.mse_loss(m(x, scale=0.5, shift=e), y)),
    "dict": (lambda: StructuredModel("dict"), _structured_loss),
    "tuple": (lambda: StructuredModel("tuple"), _structured_loss),
    "dataclass": (lambda: StructuredModel("dataclass"), _structured_loss),
    "model_output": (lambda: StructuredModel("model_output"), _structured_loss),
    "loss_inside": (LossInsideModel, lambda m, x, y, e: m(x, labels=y)),
    "reuse": (ReuseModel, _plain_loss),
    "late_input": (LateInputModel, lambda m, x, y, e: F.mse_loss(m(x, e), y)),
    "sandwich": (SandwichModel, _plain_loss),
    "callback": (CallbackModel, _plain_loss),
}


def _config(mb: int = 2, pipeline: str = "interleaved") -> dict[str, Any]:
    return {"pipeline_parallel_degree": 2, "microbatches": mb, "pipeline": pipeline, "auto_partition": False,
            "default_partition": 0}  # fmt: skip


def _data(steps: int = STEPS, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g),
             torch.randn(BATCH, D, generator=g)) for _ in range(steps)]  # fmt: skip


def _make(case: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[case][0]()


def _local_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


def _train_ranks(case: str, config: dict[str, Any]) -> dict[str, Any]:
    """Rank function: SMP training of ``case``, step inputs passed by keyword."""
    smp.init(config)
    loss_fn = CASES[case][1]
    model = smp.DistributedModel(_make(case))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model, x, y, extra)
        model.backward(loss)
        return loss

    losses = []
    for x, y, extra in _data():
        optimizer.zero_grad()
        out = train_step(model, x=x, y=y, extra=extra)
        optimizer.step()
        losses.append(out.reduce_mean().item())
    return {"losses": losses, "params": _local_params(model), "pp_rank": smp.pp_rank()}


def _reference(case: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process PyTorch on the whole batch."""
    model = _make(case)
    loss_fn = CASES[case][1]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y, extra in _data(steps):
        optimizer.zero_grad()
        loss = loss_fn(model, x, y, extra)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_against_reference(case: str, results: list[dict[str, Any]]) -> None:
    ref_losses, ref_params = _reference(case)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert not merged.keys() & r["params"].keys(), "a parameter is local on both ranks"
        merged.update(r["params"])
    assert merged.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert all(r["params"] for r in results), "each rank should own part of the model"


# ---------------------------------------------------------------------- training cases


@pytest.mark.parametrize("case", ["kwargs", "loss_inside", "reuse", "late_input", "callback"])
def test_forward_shapes_train_like_plain_pytorch(case: str) -> None:
    _check_against_reference(case, run_ranks(_train_ranks, 2, case, _config(), timeout=TIMEOUT))


@pytest.mark.parametrize("case", ["dict", "tuple", "dataclass", "model_output"])
def test_structured_outputs_of_a_remote_module_train_like_plain_pytorch(case: str) -> None:
    _check_against_reference(case, run_ranks(_train_ranks, 2, case, _config(), timeout=TIMEOUT))


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_non_contiguous_split_with_four_microbatches(pipeline: str) -> None:
    results = run_ranks(_train_ranks, 2, "sandwich", _config(mb=4, pipeline=pipeline), timeout=TIMEOUT)
    _check_against_reference("sandwich", results)
    assert set(results[1]["params"]) == {"b.0.weight", "b.0.bias", "b.2.weight", "b.2.bias", "d.weight", "d.bias"}


# ---------------------------------------------------------------------- eval, no backward


def _eval_ranks() -> dict[str, Any]:
    smp.init(_config())
    model = smp.DistributedModel(_make_dropout())

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x = _data(1)[0][0]
    model.eval()
    with torch.no_grad():
        no_grad = eval_step(model, x)
    grad_mode = eval_step(model, x)  # eval mode, grad enabled, no backward
    again = eval_step(model, x)
    return {
        "no_grad": no_grad.concat(),
        "grad_mode": grad_mode.concat(),
        "again": again.concat(),
        "requires_grad": no_grad.concat().requires_grad or grad_mode.concat().requires_grad,
        "grads": [p.grad for p in model.local_parameters()],
        "training": [m.training for m in model.local_modules()],
    }


def _make_dropout() -> nn.Module:
    torch.manual_seed(0)
    return DropoutModel()


def test_eval_steps_with_model_eval_equal_the_plain_model() -> None:
    results = run_ranks(_eval_ranks, 2, timeout=TIMEOUT)
    plain = _make_dropout().eval()
    with torch.no_grad():
        expected = plain(_data(1)[0][0])
    for rank, r in enumerate(results):
        for key in ("no_grad", "grad_mode", "again"):  # dropout off: deterministic and equal to the plain model
            torch.testing.assert_close(r[key], expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {rank} {key}: {m}")
        assert r["requires_grad"] is False  # step outputs are detached
        assert r["grads"] and all(g is None for g in r["grads"]), f"rank {rank}: eval produced gradients"
        assert r["training"] and not any(r["training"]), f"rank {rank}: a local module is still in training mode"


def _no_backward_ranks() -> dict[str, Any]:
    smp.init(_config())
    model = smp.DistributedModel(_make("reuse"))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def forward_only(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x), y)  # grad enabled, but no model.backward

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y, _ = _data(1)[0]
    first = [forward_only(model, x, y).reduce_mean().item() for _ in range(2)]
    grads_after = [p.grad for p in model.local_parameters()]
    optimizer.zero_grad()
    loss = train_step(model, x, y).reduce_mean().item()
    optimizer.step()
    return {"forward_only": first, "grads_after": grads_after, "loss": loss, "params": _local_params(model)}


def test_step_without_backward_leaves_grads_none_and_next_step_correct() -> None:
    results = run_ranks(_no_backward_ranks, 2, timeout=TIMEOUT)
    ref_losses, ref_params = _reference("reuse", steps=1)
    for rank, r in enumerate(results):
        assert r["grads_after"] and all(g is None for g in r["grads_after"]), f"rank {rank}: {r['grads_after']}"
        torch.testing.assert_close(torch.tensor(r["forward_only"]), torch.tensor(ref_losses * 2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["loss"], ref_losses[0], rtol=1e-5, atol=1e-6)
    merged = {**results[0]["params"], **results[1]["params"]}
    assert merged.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------- outputs on every rank


def _outputs_ranks() -> dict[str, Any]:
    smp.init(_config(mb=4))
    model = smp.DistributedModel(_make("sandwich"))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        pred = model(x)
        loss = F.mse_loss(pred, y)
        model.backward(loss)
        return {"loss": loss, "pred": pred, "pair": (pred.sum(), pred.shape[0]), "tag": "mb"}

    x, y, _ = _data(1)[0]
    if smp.pp_rank() == 1:  # later stages' inputs are ignored, as in SMP: give them junk
        x, y = torch.full_like(x, float("nan")), torch.zeros_like(y)
    out = train_step(model, x, y)
    return {
        "loss": out["loss"].outputs,
        "pred": out["pred"].concat(),
        "pair_sum": out["pair"][0].stack(),
        "pair_n": out["pair"][1],
        "tag": out["tag"],
    }


def test_step_outputs_are_identical_on_every_rank() -> None:
    rank0, rank1 = run_ranks(_outputs_ranks, 2, timeout=TIMEOUT)
    assert len(rank0["loss"]) == 4
    for key in ("loss", "pred", "pair_sum"):
        a, b = rank0[key], rank1[key]
        a, b = (torch.stack(a), torch.stack(b)) if isinstance(a, list) else (a, b)
        assert torch.equal(a, b), f"{key} differs between ranks: {a} vs {b}"
    assert rank0["pair_n"] == rank1["pair_n"] == [BATCH // 4] * 4
    assert rank0["tag"] == rank1["tag"] == ["mb"] * 4
    x = _data(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(rank1["pred"], _make("sandwich")(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- misuse and placement


def _outside_step_ranks() -> list[str]:
    smp.init(_config())
    model = smp.DistributedModel(_make("sandwich"))
    x, y, _ = _data(1)[0]
    messages = []

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    for when in ("before the first step", "after a step"):
        try:
            with torch.no_grad():
                model(x)
        except FwdExecutionNotInStepFnError as exc:
            messages.append(f"{when}: {exc}")
        else:
            messages.append(f"{when}: no error")
        if when == "before the first step":
            train_step(model, x, y)
    return messages


def test_model_called_outside_a_step_raises_on_every_rank() -> None:
    for rank, messages in enumerate(run_ranks(_outside_step_ranks, 2, timeout=TIMEOUT)):
        assert len(messages) == 2
        for message in messages:
            assert "no error" not in message, f"rank {rank}: {message}"
            assert "@smp.step" in message and "pipeline_parallel_degree" in message, message


def _placement_ranks() -> dict[str, Any]:
    smp.init(_config())
    torch.manual_seed(0)
    model = smp.DistributedModel(NestedPlacement())
    smp.set_partition(model.get_module().e, 1)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y, _ = _data(1)[0]
    loss = train_step(model, x, y).reduce_mean().item()
    return {
        "params": sorted(n for n, _ in model.local_named_parameters()),
        "modules": sorted(n for n, m in model.local_named_modules() if next(m.parameters(False), None) is not None),
        "loss": loss,
    }


def test_partition_contexts_place_modules_on_their_ranks() -> None:
    rank0, rank1 = run_ranks(_placement_ranks, 2, timeout=TIMEOUT)
    assert rank0["params"] == ["a.bias", "a.weight", "c.bias", "c.weight"]  # c: the innermost block (0) wins
    assert rank1["params"] == ["b.bias", "b.weight", "d.0.bias", "d.0.weight", "e.bias", "e.weight"]
    assert rank0["modules"] == ["a", "c"] and rank1["modules"] == ["b", "d.0", "e"]
    torch.manual_seed(0)
    x, y, _ = _data(1)[0]
    expected = F.mse_loss(NestedPlacement()(x), y).item()
    assert rank0["loss"] == rank1["loss"] == pytest.approx(expected, rel=1e-6)
