"""``smp-compat checkpoint merge --optimizer-output`` of a shard_optimizer_state checkpoint is the plain torch dict.

Each rdp rank holds the state of its share only; the merged dict must still be the user's optimizer: its index
order and param groups (AWS's scripts build a weight-decay and a no-decay group), so that torch's own
``load_state_dict`` (by index) puts every state on its parameter. Here tp = 2 x rdp = 2 on 4 ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import tp_models as tm
from smp_compat.testing import run_ranks

STEPS = 2


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """AWS's split: no weight decay for biases and LayerNorm weights."""
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith("bias") or ".ln" in n or "layernorm" in n or n.startswith("ln.")]
    ids = {id(p) for p in no_decay}
    return [{"params": [p for _, p in named if id(p) not in ids], "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip


def _adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=1e-2, eps=1e-4)


def _job(directory: str) -> None:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(tm.TinySmpLM(smp.nn))
    opt = smp.DistributedOptimizer(_adamw(_groups(model.get_module())))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    for ids in tm.batches(STEPS):
        opt.zero_grad()
        train_step(tm.my_samples(smp, ids))
        opt.step()
    smp.save_checkpoint(directory, "s", model=model, optimizer=opt)


def test_merged_sharded_optimizer_is_the_users_plain_torch_dict(tmp_path: Path) -> None:
    import smp_compat as smp
    from smp_compat.cli import main

    run_ranks(_job, 4, str(tmp_path), timeout=180)
    assert main(["checkpoint", "merge", str(tmp_path), "-o", str(tmp_path / "m.pt"),
                 "--optimizer-output", str(tmp_path / "o.pt")]) == 0  # fmt: skip
    merged = torch.load(tmp_path / "o.pt", weights_only=True)
    ref = _reference_optimizer(smp).state_dict()
    assert [g["params"] for g in merged["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    assert [g["weight_decay"] for g in merged["param_groups"]] == [0.1, 0.0]
    assert sorted(merged["state"]) == sorted(ref["state"])
    for index, moments in ref["state"].items():  # by torch's index, as a plain load_state_dict maps them
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(merged["state"][index][key], moments[key], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{index} {key}: {m}")  # fmt: skip
    plain = tm.TinySmpLM(smp.nn)
    _adamw(_groups(plain)).load_state_dict(merged)  # torch's own checks: group sizes, state per index


def _reference_optimizer(smp: Any) -> torch.optim.Optimizer:
    """Plain PyTorch, one process, the global batch, the same two groups."""
    torch.manual_seed(0)
    model = tm.TinySmpLM(smp.nn)
    opt = _adamw(_groups(model))
    for ids in tm.batches(STEPS):
        opt.zero_grad()
        tm.lm_loss(model(ids), ids).backward()
        opt.step()
    return opt
