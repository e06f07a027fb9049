"""Tensor parallelism (smp.nn modules, tp x rdp) trains exactly like plain PyTorch on the global batch."""

from __future__ import annotations

import pytest
import torch

import tp_models as tm
from smp_compat.testing import run_ranks


def _train(tp: int, prescaled: bool, use_step: bool, post_layernorm: bool = False) -> dict:
    import smp_compat as smp

    smp.init({"tensor_parallel_degree": tp, "ddp": True, "prescaled_batch": prescaled})
    torch.manual_seed(0)
    model = smp.DistributedModel(tm.TinySmpLM(smp.nn, post_layernorm))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    local_elements = sum(p.numel() for p in model.parameters())
    shard_elements = sum(p.numel() for p in model.parameters() if model.is_distributed_parameter(p))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in tm.batches():
        mine = tm.my_samples(smp, ids)
        opt.zero_grad()
        if use_step:
            loss = train_step(mine).reduce_mean()
        else:
            loss = tm.lm_loss(model(mine), mine)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "local": local_elements, "shard": shard_elements,
            "n_dist": len(model.distributed_modules()),
            "default": sorted(n for n, _ in model.default_reducer_named_parameters()),
            "scaled": sorted(n for n, _ in model.scaled_batch_reducer_named_parameters())}  # fmt: skip


def _check(results: list[dict], tp: int, post_layernorm: bool = False) -> None:
    import smp_compat as smp

    ref_losses, ref_params = tm.reference(lambda: tm.TinySmpLM(smp.nn, post_layernorm))
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full_elements = sum(v.numel() for v in ref_params.values())
    for r in results:
        assert r["params"].keys() == ref_params.keys()
        for name, value in ref_params.items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        # each rank holds only its shard of every distributed parameter
        assert r["local"] == full_elements - r["shard"] * (tp - 1)
        assert r["shard"] > 0 and r["n_dist"] == 3
        assert set(r["default"]).isdisjoint(r["scaled"]) and "head.weight" in r["default"]
        assert "proj.weight" in r["scaled"] and "proj.bias" in r["default"]


@pytest.mark.parametrize("prescaled", [False, True])
def test_tp2_matches_single_process(prescaled: bool) -> None:
    _check(run_ranks(_train, 2, 2, prescaled, True, timeout=120), tp=2)


@pytest.mark.parametrize("prescaled", [False, True])
def test_tp2_rdp2_matches_single_process(prescaled: bool) -> None:
    _check(run_ranks(_train, 4, 2, prescaled, True, timeout=180), tp=2)


def test_tp2_plain_backward_without_step() -> None:
    _check(run_ranks(_train, 2, 2, False, False, timeout=120), tp=2)


def test_tp2_post_layernorm_matches_single_process() -> None:
    _check(run_ranks(_train, 2, 2, False, True, True, timeout=120), tp=2, post_layernorm=True)
