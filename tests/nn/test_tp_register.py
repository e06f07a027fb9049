"""Custom modules registered with smp.tp_register(_with_module): swapped at DistributedModel, trained like plain PyTorch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp_compat as smp
import tp_models as tm

HIDDEN, INNER = tm.HIDDEN, 2 * tm.HIDDEN


class MyMLP(nn.Module):
    """A user's block; its distributed version is registered with hooks below."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor]:
        return (x + self.fc2(F.relu(self.fc1(x))) * scale,)


class DistMLP(smp.nn.DistributedModule):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_dropout_prob: float = 0.1) -> None:
        super().__init__()
        self.output = smp.nn.DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, "relu", pre_layernorm=True, post_layernorm=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(x)


def _init_hook(hidden: int, inner: int) -> tuple[tuple, dict]:
    return (), {"hidden_size": hidden, "intermediate_size": inner}


def _forward_hook(x: torch.Tensor, scale: float = 1.0) -> tuple[tuple, dict]:
    return (x,), {}


smp.tp_register_with_module(MyMLP, DistMLP, _init_hook, _forward_hook, lambda out: (out,))


class Net(nn.Module):
    def __init__(self, inner: int = INNER, tie: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(tm.VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([MyMLP(HIDDEN, inner) for _ in range(2)])
        if tie:
            self.blocks[1].fc1.weight = self.blocks[0].fc1.weight
        self.head = nn.Linear(HIDDEN, tm.VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for block in self.blocks:
            h = block(h, scale=2.0)[0]
        return self.head(h)


def _build(inner: int = INNER, tie: bool = False) -> nn.Module:
    with smp.tensor_parallelism(hidden_dropout_prob=0.0):
        return Net(inner, tie)


def _reference_model() -> nn.Module:
    from smp_compat.nn.swap import swap_modules

    return swap_modules(_build())


def _train(prescaled: bool) -> dict:
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    model = smp.DistributedModel(_build())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    swapped = [type(b).__name__ for b in model.get_module().blocks]

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in tm.batches():
        opt.zero_grad()
        losses.append(train_step(tm.my_samples(smp, ids)).reduce_mean().item())
        opt.step()
    return {"losses": losses, "swapped": swapped, "params": {k: v.clone() for k, v in model.state_dict().items()},
            "local": sum(p.numel() for p in model.parameters())}  # fmt: skip


@pytest.mark.parametrize("prescaled", [False, True])
def test_registered_module_tp2_matches_single_process(prescaled: bool) -> None:
    from smp_compat.testing import run_ranks

    results = run_ranks(_train, 2, prescaled, timeout=120)
    ref_losses, ref_params = tm.reference(_reference_model)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)  # each rank's loss is over its own samples
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["swapped"] == ["DistMLP", "DistMLP"]
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        sharded = 2 * (2 * HIDDEN * INNER + INNER)  # dense1 weight+bias, dense2 weight, per block
        assert r["local"] == sum(v.numel() for v in ref_params.values()) - sharded // 2


def _unswapped(inner: int, tie: bool) -> dict:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("smp_compat").addHandler(Keep())
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    model = smp.DistributedModel(_build(inner, tie))
    return {"types": [type(b).__name__ for b in model.get_module().blocks], "messages": messages}


def test_modules_left_unswapped_say_why() -> None:
    from smp_compat.testing import run_ranks

    odd, tied = run_ranks(_unswapped, 2, INNER + 1, False, timeout=60)[0], run_ranks(_unswapped, 2, INNER, True, timeout=60)[0]
    assert odd["types"] == ["MyMLP", "MyMLP"]
    assert len(odd["messages"]) == 2 and all("not divisible" in m for m in odd["messages"])
    assert tied["types"] == ["MyMLP", "MyMLP"]
    assert len(tied["messages"]) == 2 and all("shared with another module" in m for m in tied["messages"])


def test_set_tensor_parallelism_marks_outermost_and_disables_subtree() -> None:
    net = Net()
    from smp_compat.nn.registry import mark_of

    assert mark_of(net.blocks[0]) is None
    smp.set_tensor_parallelism(net, True, hidden_dropout_prob=0.0)
    assert mark_of(net.blocks[0]) == (True, {"hidden_dropout_prob": 0.0}) and mark_of(net) is None
    smp.set_tensor_parallelism(net.blocks[1], False)
    assert mark_of(net.blocks[1]) == (False, {})
    with smp.tensor_parallelism(False):
        assert mark_of(MyMLP(4, 4)) == (False, {})
    with smp.tensor_parallelism():
        with smp.tensor_parallelism(enabled=False):
            assert mark_of(MyMLP(4, 4))[0] is False  # innermost wins


def test_tp_register_decorator_requires_a_distributed_module() -> None:
    with pytest.raises(smp.SMPConfigError, match="DistributedModule"):
        smp.tp_register(nn.Linear)(MyMLP)

    @smp.tp_register(DistMLP, _init_hook)
    class Other(MyMLP):
        pass

    from smp_compat.nn.registry import lookup

    assert lookup(Other).dist_cls is DistMLP and lookup(Other).forward_hook is None
