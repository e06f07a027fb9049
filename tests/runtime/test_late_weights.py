"""Served backwards that reply before their weight gradients (runtime/late_weights.py) change no number."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp_compat import timeline
from smp_compat.runtime import late_weights
from smp_compat.runtime.late_weights import WeightGradients, accumulate, splitting_linears
from smp_compat.testing import RankFailure, run_ranks
from test_pp_fidelity import _check, _config, _train_pipeline


def _grads(model: nn.Module, x: torch.Tensor, split: bool, seed_grads: bool) -> tuple[torch.Tensor, list]:
    """Input and parameter gradients of one backward, the split way or autograd's own."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5) if seed_grads else None
    x = x.detach().requires_grad_()
    store = WeightGradients()
    with splitting_linears(store) if split else torch.enable_grad():
        y = model(x)
    store.collecting = True
    y.backward(torch.ones_like(y) / 3)
    store.collecting = False
    accumulate(store.take())
    return x.grad, [p.grad.clone() for p in model.parameters()]


class _Tied(nn.Module):
    """One weight in two products (its contributions are summed before they reach ``.grad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


@pytest.mark.parametrize("shape", [(6, 32), (2, 5, 32), (2, 3, 4, 32)])
@pytest.mark.parametrize("seed_grads", [False, True])
def test_split_backward_is_bitwise_autograd(shape: tuple, seed_grads: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(late_weights, "MIN_MULTIPLY_ADDS", 0)
    torch.manual_seed(0)
    model = _Tied()
    _assert_same_gradients(model, model, torch.randn(*shape), seed_grads)


def _assert_same_gradients(plain_model: nn.Module, split_model: nn.Module, x: torch.Tensor, seed_grads: bool) -> None:
    plain_x, plain_params = _grads(plain_model, x, split=False, seed_grads=seed_grads)
    split_x, split_params = _grads(split_model, x, split=True, seed_grads=seed_grads)
    assert torch.equal(plain_x, split_x)
    for plain, split in zip(plain_params, split_params):
        assert torch.equal(plain, split)


def test_backward_outside_the_engine_gets_every_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward the engine does not run (the user's own, a double backward) is autograd's usual one."""
    monkeypatch.setattr(late_weights, "MIN_MULTIPLY_ADDS", 0)
    lin, x = nn.Linear(8, 4), torch.randn(3, 8, requires_grad=True)
    store = WeightGradients()
    with splitting_linears(store):
        y = lin(x)
    assert y.grad_fn.name().startswith("SplitLinear")
    gx, gw, gb = torch.autograd.grad(y.square().sum(), (x, lin.weight, lin.bias), create_graph=True)
    ref = torch.autograd.grad(F.linear(x, lin.weight, lin.bias).square().sum(), (x, lin.weight, lin.bias), create_graph=True)
    for got, want in zip((gx, gw, gb), ref):
        torch.testing.assert_close(got, want)
    assert not store.take()


def test_only_plain_large_products_split(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 8)
    lin = nn.Linear(8, 8)
    assert not late_weights._plain(x, lin.weight, lin.bias)  # 256 multiply-adds: below the default threshold
    monkeypatch.setattr(late_weights, "MIN_MULTIPLY_ADDS", 0)
    assert late_weights._plain(x, lin.weight, lin.bias)
    assert not late_weights._plain(x.t(), lin.weight, lin.bias)  # not contiguous
    assert not late_weights._plain(x, lin.weight.detach(), lin.bias)  # not a parameter
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not late_weights._plain(x, lin.weight, lin.bias)
    handle = lin.weight.register_post_accumulate_grad_hook(lambda p: None)  # expects its gradient in the backward
    assert not late_weights._plain(x, lin.weight, lin.bias)
    handle.remove()
    lin.bias.register_hook(lambda g: g)
    assert not late_weights._plain(x, lin.weight, lin.bias)
    with torch.autograd.graph.save_on_cpu():  # saved-tensor hooks: a checkpoint's recomputation saves plainly
        assert not late_weights._plain(x, nn.Linear(8, 8).weight)
    with torch.autograd.forward_ad.dual_level():  # forward-mode AD would need the Function's jvp
        assert not late_weights._plain(x, nn.Linear(8, 8).weight)
    assert late_weights._plain(x, nn.Linear(8, 8).weight)


def test_vmap_inside_a_split_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.func`` transforms keep autograd's products (a Function under vmap needs ``setup_context``)."""
    monkeypatch.setattr(late_weights, "MIN_MULTIPLY_ADDS", 0)
    lin, x = nn.Linear(8, 8), torch.randn(5, 3, 8)
    with splitting_linears(WeightGradients()):
        got = torch.vmap(lin)(x)
    torch.testing.assert_close(got, lin(x))


def test_checkpoint_inside_a_split_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-reentrant checkpoint recomputes outside the mode: its products stay autograd's own."""
    monkeypatch.setattr(late_weights, "MIN_MULTIPLY_ADDS", 0)
    torch.manual_seed(0)
    model = _Tied()
    _assert_same_gradients(model, _Checkpointed(model), torch.randn(6, 32), seed_grads=False)


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert late_weights.enabled(2) and not late_weights.enabled(1)
    monkeypatch.setenv(late_weights.ENV, "0")
    assert not late_weights.enabled(2)


def _train_every_product_split(config: dict, manual: bool) -> dict:
    """The fidelity run with every served product split (the test model's are below the size threshold)."""
    from smp_compat.runtime import serving

    late_weights.MIN_MULTIPLY_ADDS = 0
    added = []
    original = serving.accumulate
    serving.accumulate = lambda entries: (added.append(len(entries)), original(entries))[1]
    recorder = timeline.enable(int(os.environ["RANK"]))
    result = _train_pipeline(config, manual)
    result["split"] = sum(added)
    result["mislabelled"] = _mislabelled_weight_passes(recorder.spans)
    return result


def _mislabelled_weight_passes(spans: list[timeline.Span]) -> list[str]:
    """Weight passes whose timeline name is not the served backward they finish: the latest one done before."""
    computed = sorted((s for s in spans if s.track == "compute"), key=lambda s: s.start)
    wrong, last_backward = [], None
    for span in computed:
        if span.name.startswith("serve-bwd-mb"):
            last_backward = span.name.removeprefix("serve-bwd-mb")
        elif span.name.startswith("weights-mb") and span.name.removeprefix("weights-mb") != last_backward:
            wrong.append(f"{span.name} after serve-bwd-mb{last_backward}")
    return wrong


@pytest.mark.parametrize(
    ("pp", "extra"),
    [(2, {}), (3, {}), (2, {"ddp": True}), (2, {"deterministic_server": True})],
)
def test_pipeline_with_every_product_split_matches_single_process(pp: int, extra: dict) -> None:
    world = pp * (2 if extra.get("ddp") else 1)
    config = _config(pp, 4, "interleaved", auto=False, **extra)
    results = run_ranks(_train_every_product_split, world, config, True, timeout=150)
    _check(results)
    served = [r["split"] for r in results if r["pp_rank"] != 0]
    if extra.get("deterministic_server"):  # its gradient hooks expect every gradient inside the backward
        assert served == [0] * len(served)
    else:
        assert all(n > 0 for n in served), served
    assert [r["mislabelled"] for r in results] == [[]] * world


def _train_with_failing_weight_pass(config: dict, manual: bool) -> dict:
    from smp_compat.runtime import serving

    calls = []

    def fails_once(entries: list) -> None:  # the first weight pass runs in a task or after a reply
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("weight gradients failed on purpose")
        late_weights.accumulate(entries)

    late_weights.MIN_MULTIPLY_ADDS = 0
    serving.accumulate = fails_once
    return _train_pipeline(config, manual)


def test_a_failing_weight_pass_fails_the_step_on_every_rank() -> None:
    """No task waits for a weight pass: its error must still end the step, never leave a gradient out."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_train_with_failing_weight_pass, 2, _config(2, 4, "interleaved", auto=False), True, timeout=60)
    assert time.monotonic() - start < 30
    assert "RuntimeError: weight gradients failed on purpose" in str(info.value), str(info.value)[-3000:]
