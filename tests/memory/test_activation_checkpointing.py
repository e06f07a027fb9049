"""Activation checkpointing: same gradients as without it, less saved activation memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import causal_mask, lm_loss, make_model, place_blocks_by_stage, reference_training, train_smp
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH = 3, 8


def _train(config: dict, how: str) -> dict:
    import smp_compat as smp

    smp.init(config)
    model = smp.DistributedModel(make_model())
    if smp.pp_size() > 1:
        place_blocks_by_stage(smp, model)
    if how == "mark":
        for block in model.module.blocks:
            smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    mask = causal_mask(8)

    def forward(module, x):
        x0 = module.embed(x) + module.pos[: x.shape[1]]
        h = x0
        for block in module.blocks:
            h = smp.checkpoint(block, h, mask)
        return module.head(module.ln_f(h) + 0.5 * x0)

    @smp.step
    def train_step(model, x, y):
        logits = forward(model.module, x) if how == "call" else model(x, attention_mask=mask)
        loss = lm_loss(logits, y)
        model.backward(loss)
        return loss

    losses = train_smp(smp, model, opt, train_step, STEPS, GLOBAL_BATCH)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.local_named_parameters()}}


def _check(results: list[dict]) -> None:
    ref_losses, ref_state = reference_training(STEPS, GLOBAL_BATCH)
    merged = {}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        merged.update(r["params"])
    for name, value in merged.items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


BASE = {"microbatches": 2, "auto_partition": False, "default_partition": 0}


@pytest.mark.parametrize("how", ["mark", "call"])
def test_pp2_checkpointed_blocks_match_plain_pytorch(how: str) -> None:
    _check(run_ranks(_train, 2, {**BASE, "pipeline_parallel_degree": 2}, how, timeout=90))


def test_pp2_dp2_checkpointed_blocks_match_plain_pytorch() -> None:
    _check(run_ranks(_train, 4, {**BASE, "pipeline_parallel_degree": 2, "ddp": True}, "mark", timeout=120))


def _saved_bytes(checkpointed: bool) -> int:
    """Bytes of tensors autograd saves for backward during one forward of the model."""
    import smp_compat as smp

    smp.init({"microbatches": 1})
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)])
    model = smp.DistributedModel(net)
    if checkpointed:
        smp.set_activation_checkpointing(net, strategy="each")
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size() if not isinstance(t, nn.Parameter) else 0
        return t

    @smp.step
    def train_step(model, x):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        model.backward(out.pow(2).mean())
        return out

    train_step(model, torch.randn(32, 64))
    return saved[0]


def test_checkpointing_saves_less_activation_memory() -> None:
    plain, checkpointed = run_ranks(_saved_bytes, 1, False)[0], run_ranks(_saved_bytes, 1, True)[0]
    assert checkpointed < plain / 2, (plain, checkpointed)


def test_set_activation_checkpointing_needs_the_model_first() -> None:
    import smp_compat as smp

    smp.init({})
    with pytest.raises(smp.SMPError, match="after smp.DistributedModel"):
        smp.set_activation_checkpointing(nn.Linear(2, 2))
    model = smp.DistributedModel(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="strategy"):
        smp.set_activation_checkpointing(model.module, strategy="everything")
    with pytest.raises(ValueError, match="only applies to nn.Sequential"):
        smp.set_activation_checkpointing(model.module[0], strategy="group_2")


def test_offload_activations_on_cpu_is_accepted_with_a_notice(caplog: pytest.LogCaptureFixture) -> None:
    import smp_compat as smp

    with caplog.at_level("WARNING", logger="smp_compat"):
        smp.init({"offload_activations": True, "microbatches": 2})
    assert "does nothing" in caplog.text and smp.state.cfg.offload_activations
    assert "offload_activations" not in smp.state.cfg.not_acted_on()


def _forward_calls(checkpointed: bool) -> dict[str, int]:
    """How often each block's forward runs in one training step (twice per microbatch when recomputed)."""
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    calls: dict[str, int] = {}

    class Counted(nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name, self.lin = name, nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls[self.name] = calls.get(self.name, 0) + 1
            return torch.tanh(self.lin(x))

    torch.manual_seed(0)
    net = nn.Sequential(Counted("a"), Counted("b"), Counted("c"), Counted("d"))
    model = smp.DistributedModel(net)
    smp.set_partition(net[2], 1)
    smp.set_partition(net[3], 1)
    if checkpointed:
        for block in net:
            smp.set_activation_checkpointing(block)

    @smp.step
    def train_step(model, x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    train_step(model, torch.randn(4, 4))
    return calls


def test_checkpointed_blocks_are_recomputed_on_their_own_rank() -> None:
    plain = run_ranks(_forward_calls, 2, False, timeout=60)
    recomputed = run_ranks(_forward_calls, 2, True, timeout=60)
    assert plain == [{"a": 2, "b": 2}, {"c": 2, "d": 2}]
    assert recomputed == [{"a": 4, "b": 4}, {"c": 4, "d": 4}]
