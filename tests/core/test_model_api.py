"""DistributedModel, DistributedOptimizer and @smp.step at pp = 1 (SMP_REFERENCE §2.1-§2.4, §4.1-§4.3)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp_compat as smp
from smp_compat.errors import (
    DistributedModelNotCreatedError,
    MultipleDistributedModelError,
    ParameterOwnershipError,
    SMPConfigError,
    SMPUnsupportedError,
    StepUsageError,
    TensorSplitError,
)
from smp_compat.stepping.step import StepFunction
from smp_compat.testing import run_ranks

__all__: list[str] = []


class Net(nn.Module):
    """Two layers and a buffer that forward reads but never changes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("offset", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) + self.offset


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_data(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, generator=g), torch.randn(batch, 3, generator=g)


def grads_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")



@smp.step
def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _wrapped(config: dict[str, Any] | None = None, seed: int = 0, **model_kwargs: Any) -> tuple[Any, Any]:
    smp.init(config or {})
    model = smp.DistributedModel(make_net(seed), **model_kwargs)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, opt


# ---------------------------------------------------------------------------- misuse errors


def test_backward_outside_a_step_is_a_usage_error() -> None:
    model, _ = _wrapped()
    x, y = make_data(4, 1)
    loss = F.mse_loss(model(x), y)
    with pytest.raises(StepUsageError, match=r"outside an @smp\.step function"):
        model.backward(loss)
    assert all(p.grad is None for p in model.parameters())


def test_retain_graph_is_unsupported() -> None:
    model, _ = _wrapped()

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss, retain_graph=True)
        return loss

    with pytest.raises(SMPUnsupportedError, match="retain_graph"):
        step(model, *make_data(4, 1))


def test_backward_of_a_per_sample_loss_without_grad_tensors_is_refused() -> None:
    """loss.backward() refuses a non-scalar loss; seeding it with ones would silently train on the sum."""
    model, _ = _wrapped()

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        loss = F.mse_loss(model(x), y, reduction="none")
        model.backward(loss, grad)
        return loss.mean()

    x, y = make_data(4, 1)
    with pytest.raises(StepUsageError, match=r"shape \(4, 3\) and no grad_tensors.*loss\.mean\(\)"):
        step(model, x, y, None)
    assert all(p.grad is None for p in model.parameters())
    step(model, x, y, torch.ones_like(y) / 4)  # explicit gradients are fine
    assert all(p.grad is not None for p in model.parameters())


def test_step_decorates_a_method_as_it_does_a_function() -> None:
    """``@smp.step`` on ``def train_step(self, model, x, y)`` binds ``self`` like any method."""
    model, _ = _wrapped({"microbatches": 2})

    class Loop:
        scale = 3.0

        @smp.step
        def train_step(self, model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = self.scale * F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

    x, y = make_data(4, 1)
    loss = Loop().train_step(model, x, y).reduce_mean()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = 3.0 * F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    torch.testing.assert_close(loss, train_step(model, x, y).reduce_mean())
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert isinstance(Loop.train_step, StepFunction)  # on the class: the step function itself


def test_second_distributed_model_is_refused() -> None:
    smp.init({})
    smp.DistributedModel(make_net())
    with pytest.raises(MultipleDistributedModelError, match="already exists"):
        smp.DistributedModel(make_net())


def test_distributed_optimizer_before_the_model_is_refused() -> None:
    smp.init({})
    net = make_net()
    with pytest.raises(DistributedModelNotCreatedError, match="before smp.DistributedModel"):
        smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))


def test_optimizer_with_a_foreign_parameter_is_refused() -> None:
    smp.init({})
    model = smp.DistributedModel(make_net())
    stray = nn.Parameter(torch.zeros(5, 2))
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [stray]}], lr=0.1)
    with pytest.raises(ParameterOwnershipError, match=r"param_groups\[1\].*shape \(5, 2\)") as info:
        smp.DistributedOptimizer(opt)
    assert isinstance(info.value, RuntimeError)  # SMP raised RuntimeError; except clauses keep working


def test_added_group_with_a_foreign_parameter_is_refused_and_not_kept() -> None:
    _, opt = _wrapped()
    with pytest.raises(ParameterOwnershipError, match=r"param_groups\[1\].*shape \(5, 2\)"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(5, 2))]})
    assert len(opt.param_groups) == 1 and len(opt.state_dict()["param_groups"]) == 1


def test_init_twice_warns_and_keeps_the_first_config() -> None:
    smp.init({"microbatches": 2})
    with pytest.warns(UserWarning, match="already called"):
        smp.init({"microbatches": 4})
    assert smp.num_microbatches() == 2


def test_unknown_config_key_names_it() -> None:
    with pytest.raises(SMPConfigError, match=r'unknown key "microbatchez".*did you mean "microbatches"'):
        smp.init({"microbatchez": 2})
    assert not smp.is_initialized()


# ---------------------------------------------------------------------------- life cycle


def test_local_parameters_raise_before_the_first_step_and_work_after() -> None:
    model, _ = _wrapped()
    for call in (model.local_parameters, model.local_named_parameters, model.local_buffers, model.local_modules):
        with pytest.raises(StepUsageError, match="after the first step"):
            list(call())
    assert not model.partitioned
    train_step(model, *make_data(4, 1))
    assert model.partitioned
    assert [id(p) for p in model.local_parameters()] == [id(p) for p in model.module.parameters()]
    assert [n for n, _ in model.local_named_buffers()] == ["offset"]
    assert model.is_local_parameter("fc1.weight") and model.is_local_parameter(model.module.fc2.bias)


def test_post_partition_hook_runs_once_before_the_first_forward() -> None:
    model, opt = _wrapped()
    events: list[Any] = []
    model.module.register_forward_pre_hook(lambda *_: events.append("forward"))
    model.register_post_partition_hook(lambda m, o: events.append(("partition_hook", m, o, m.partitioned)))
    removed = model.register_post_partition_hook(lambda m, o: events.append("removed"))
    removed.remove()
    data = make_data(4, 1)
    train_step(model, *data)
    train_step(model, *data)
    assert events == [("partition_hook", model, opt, True), "forward", "forward"]


def test_post_step_hook_runs_once_after_the_first_step() -> None:
    model, opt = _wrapped({"microbatches": 2})
    events: list[Any] = []
    model.module.register_forward_pre_hook(lambda *_: events.append("forward"))

    def hook(m: Any, o: Any) -> None:
        events.append(("post_step", m is model, o is opt, all(p.grad is not None for p in m.parameters())))

    model.register_post_step_hook(hook)
    data = make_data(4, 1)
    train_step(model, *data)
    train_step(model, *data)
    assert events == ["forward", "forward", ("post_step", True, True, True), "forward", "forward"]


def test_pp1_forward_outside_a_step_works_like_the_module() -> None:
    model, _ = _wrapped()
    reference = make_net()
    x, y = make_data(6, 1)
    out = model(x)
    torch.testing.assert_close(out, reference(x))
    F.mse_loss(out, y).backward()  # plain autograd, as the DG's TP-only example does
    F.mse_loss(reference(x), y).backward()
    assert_grads_close(grads_of(model.module), grads_of(reference))


# ---------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("average", [True, False])
def test_microbatch_grads_are_averaged_or_summed(average: bool) -> None:
    model, _ = _wrapped({"microbatches": 2}, average_grads_across_microbatches=average)
    x, y = make_data(8, 1)
    out = train_step(model, x, y)
    reference = make_net()
    for xs, ys in zip(x.split(4), y.split(4)):  # one mean loss per microbatch, grads summed by autograd
        (F.mse_loss(reference(xs), ys) / (2 if average else 1)).backward()
    assert_grads_close(grads_of(model.module), grads_of(reference))
    torch.testing.assert_close(out.reduce_mean(), F.mse_loss(make_net()(x), y))


def test_eval_step_under_no_grad_returns_outputs_without_grads_or_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _wrapped({"microbatches": 2})
    calls: list[int] = []
    real = model._average_gradients
    monkeypatch.setattr(model, "_average_gradients", lambda: (calls.append(1), real())[1])

    @smp.step
    def eval_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x, _ = make_data(6, 1)
    with torch.no_grad():
        out = eval_step(model, x)
    assert len(out.outputs) == 2 and not out.outputs[0].requires_grad
    torch.testing.assert_close(out.concat(), make_net()(x).detach())
    assert all(p.grad is None for p in model.parameters())
    assert calls == []
    train_step(model, *make_data(6, 2))
    assert calls == [1]  # the spy does see the sync of a training step


def test_detach_outputs_false_keeps_the_graph() -> None:
    model, _ = _wrapped({"microbatches": 2})

    @smp.step(detach_outputs=False)
    def kept(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    @smp.step
    def detached(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    x, _ = make_data(4, 1)
    assert all(o.grad_fn is not None for o in kept(model, x).outputs)
    assert all(o.grad_fn is None and not o.requires_grad for o in detached(model, x).outputs)


def test_step_outputs_of_tuples_and_dicts() -> None:
    model, _ = _wrapped({"microbatches": 2})

    @smp.step
    def as_tuple(model: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        logits = model(x)
        loss = F.mse_loss(logits, y)
        model.backward(loss)
        return loss, logits, "tag"

    @smp.step
    def as_dict(model: Any, x: torch.Tensor) -> dict[str, Any]:
        logits = model(x)
        return {"logits": logits, "norm": logits.norm()}

    x, y = make_data(6, 1)
    reference = make_net()(x).detach()
    loss, logits, tag = as_tuple(model, x, y)
    assert isinstance(loss, smp.StepOutput) and isinstance(logits, smp.StepOutput)
    assert tag == ["tag", "tag"]  # a non-tensor leaf comes back as one entry per microbatch
    torch.testing.assert_close(logits.concat(), reference)
    torch.testing.assert_close(loss.reduce_mean(), F.mse_loss(reference, y))
    with torch.no_grad():
        out = as_dict(model, x)
    assert set(out) == {"logits", "norm"} and all(isinstance(v, smp.StepOutput) for v in out.values())
    torch.testing.assert_close(out["norm"].stack(), torch.stack([c.norm() for c in reference.split(3)]))


def test_non_divisible_batch_names_the_argument() -> None:
    model, _ = _wrapped({"microbatches": 2})
    x, y = make_data(5, 1)
    with pytest.raises(TensorSplitError, match=r"`x`.*shape \(5, 4\).*not divisible by 2"):
        train_step(model, x, y)


def test_non_split_inputs_and_split_axes_through_a_model_call() -> None:
    model, _ = _wrapped({"microbatches": 2})
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    @smp.step(non_split_inputs=["bias"], input_split_axes={"xt": 1})
    def step(model: Any, xt: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(xt.shape), tuple(bias.shape)))
        return model(xt.t()) + bias

    x, _ = make_data(6, 1)
    bias = torch.tensor([1.0, 2.0, 3.0])  # 3 does not divide by 2: splitting it would raise
    with torch.no_grad():
        out = step(model, x.t().contiguous(), bias=bias)
    assert seen == [((4, 3), (3,)), ((4, 3), (3,))]
    torch.testing.assert_close(out.concat(), make_net()(x).detach() + bias)


# ---------------------------------------------------------------------------- two ranks (forked)


def _accumulate_two_steps() -> dict[str, Any]:
    """backward_passes_per_step=2: the first step keeps local grads, the second averages the sum."""
    smp.init({"microbatches": 2, "ddp": True})
    model = smp.DistributedModel(make_net(), backward_passes_per_step=2)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y) / 2  # the user scales by 1 / backward_passes_per_step, as HF does
        model.backward(loss)
        return loss

    after = []
    for s in range(2):
        step(model, *make_data(8, seed=10 * s + smp.dp_rank()))
        after.append(grads_of(model.module))
    return {"rank": smp.dp_rank(), "after_step1": after[0], "after_step2": after[1]}


def test_backward_passes_per_step_syncs_every_second_step() -> None:
    results = run_ranks(_accumulate_two_steps, 2, timeout=30)
    local_first = []
    for rank in range(2):
        reference = make_net()
        (F.mse_loss(reference(make_data(8, seed=rank)[0]), make_data(8, seed=rank)[1]) / 2).backward()
        local_first.append(grads_of(reference))
    for r in results:
        assert_grads_close(r["after_step1"], local_first[r["rank"]])  # not synced after the first call
    assert not torch.allclose(results[0]["after_step1"]["fc1.weight"], results[1]["after_step1"]["fc1.weight"])
    reference = make_net()
    for rank in range(2):
        for s in range(2):
            x, y = make_data(8, seed=10 * s + rank)
            (F.mse_loss(reference(x), y) / 2 / 2).backward()  # / 2 for the dp average over two ranks
    for r in results:
        assert_grads_close(r["after_step2"], grads_of(reference))


def _failed_step_then_eval() -> dict[str, Any]:
    """A train step that fails after its backward (caught), an eval step, then a train step."""
    smp.init({"microbatches": 2, "ddp": True})
    model = smp.DistributedModel(make_net(), backward_passes_per_step=2)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor, fail: bool) -> torch.Tensor:
        loss = F.mse_loss(model(x), y) / 2
        if torch.is_grad_enabled():
            model.backward(loss)
        if fail:
            raise KeyError("after backward")
        return loss

    step(model, *make_data(8, seed=smp.dp_rank()), False)
    with pytest.raises(KeyError):
        step(model, *make_data(8, seed=smp.dp_rank()), True)
    optimizer.zero_grad()
    with torch.no_grad():
        step(model, *make_data(8, seed=smp.dp_rank()), False)  # no backward: not a pass to count
    step(model, *make_data(8, seed=10 + smp.dp_rank()), False)  # the second pass: gradients averaged
    return grads_of(model.module)


def test_a_failed_steps_backward_does_not_count_for_a_later_step_without_one() -> None:
    """The failed step never finished: an eval step after it used to count as a backward pass, so the
    gradient sync of backward_passes_per_step = 2 came one step early and replicas diverged silently."""
    results = run_ranks(_failed_step_then_eval, 2, timeout=30)
    reference = make_net()
    for rank in range(2):
        x, y = make_data(8, seed=10 + rank)
        (F.mse_loss(reference(x), y) / 2 / 2).backward()
    for grads in results:
        assert_grads_close(grads, grads_of(reference))


def _replicas_after_first_step(broadcast_buffers: bool) -> dict[str, Any]:
    smp.init({"ddp": True})
    net = make_net(seed=100 + smp.rank())  # different initial weights and buffer on each rank
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = smp.DistributedModel(net, broadcast_buffers=broadcast_buffers)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    train_step(model, *make_data(4, seed=smp.rank()))
    return {"before": before, "after": {k: v.clone() for k, v in net.state_dict().items()}}


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_params_and_buffers_come_from_dp_rank_0_at_the_first_step(broadcast_buffers: bool) -> None:
    r0, r1 = run_ranks(_replicas_after_first_step, 2, broadcast_buffers, timeout=30)
    assert not torch.equal(r0["before"]["fc1.weight"], r1["before"]["fc1.weight"])
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        torch.testing.assert_close(r0["after"][name], r0["before"][name], rtol=0, atol=0)
        torch.testing.assert_close(r1["after"][name], r0["before"][name], rtol=0, atol=0)
    expected_offset = r0["before"]["offset"] if broadcast_buffers else r1["before"]["offset"]
    torch.testing.assert_close(r1["after"]["offset"], expected_offset, rtol=0, atol=0)
