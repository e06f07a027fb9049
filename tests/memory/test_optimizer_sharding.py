"""shard_optimizer_state (ZeRO-1 over data parallelism): same training, about 1/dp optimizer state per rank."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models import (
    lm_train_step,
    make_batches,
    make_model,
    place_blocks_by_stage,
    plain_training,
    reference_training,
    train_smp,
)
from smp_compat.checkpoints.optimizer_state import merge_optimizer_parts
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH = 3, 8


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _adagrad(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Makes its state for every parameter in ``__init__``, before the shares are known."""
    return torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=0.1)


def _train(pp: int, shard: bool, make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = _adam) -> dict:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "ddp": True, "shard_optimizer_state": shard,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    model = smp.DistributedModel(make_model())
    if pp > 1:
        place_blocks_by_stage(smp, model)
    opt = smp.DistributedOptimizer(make_optimizer(model))
    train_smp(smp, model, opt, lm_train_step(smp), STEPS, GLOBAL_BATCH)
    state_elems = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    local_elems = sum(p.numel() for p in model.local_parameters())
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "state_fraction": state_elems / (2 * local_elems), "local": opt.local_state_dict()}  # fmt: skip


@pytest.mark.parametrize("pp", [1, 2])
def test_sharded_adam_trains_exactly_like_plain_pytorch(pp: int) -> None:
    results = run_ranks(_train, 2 * pp, pp, True, timeout=120)
    _, ref_state = reference_training(STEPS, GLOBAL_BATCH)
    merged = {}
    for r in results:
        merged.update(r["params"])
        assert 0.2 < r["state_fraction"] < 0.8, r["state_fraction"]  # about half of Adam's two moments
    assert merged.keys() == {n for n, _ in make_model().named_parameters()}
    for name, value in merged.items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_full_optimizer_state_dict_is_refused_when_sharded() -> None:
    def body() -> str:
        import smp_compat as smp

        smp.init({"microbatches": 1, "ddp": True, "shard_optimizer_state": True})
        model = smp.DistributedModel(torch.nn.Linear(4, 4))
        opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))
        try:
            opt.state_dict()
        except smp.SMPUnsupportedError as exc:
            return str(exc)
        return "no error"

    assert "shard_optimizer_state" in run_ranks(body, 2, timeout=60)[0]


def test_sharded_adagrad_keeps_only_its_share_and_merges_into_plain_torchs_dict() -> None:
    """Adagrad's state made in ``__init__`` for other ranks' shares is dropped: local_state_dict() works (it
    raised a KeyError inside torch) and the parts merge into what plain PyTorch's optimizer holds."""
    results = run_ranks(_train, 2, 1, True, _adagrad, timeout=120)
    parts = [r["local"] for r in results]
    owned = [{part["_smp_param_names"][i] for i in part["state"]} for part in parts]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    expected = plain_training(STEPS, GLOBAL_BATCH, _adagrad)[2].state_dict()
    merged = merge_optimizer_parts(parts)
    assert [g["params"] for g in merged["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert sorted(merged["state"]) == sorted(expected["state"])
    for index, value in expected["state"].items():
        torch.testing.assert_close(merged["state"][index]["sum"], value["sum"], rtol=1e-5, atol=1e-6)
        assert merged["state"][index]["step"] == value["step"]


def _save_gathered(steps: int) -> dict:
    """AWS's 2021-22 GPT-2 script: every rank calls local_state_dict(gather_if_shard=1), rdp_rank 0 saves it."""
    import smp_compat as smp

    smp.init({"microbatches": 2, "ddp": True, "shard_optimizer_state": True})
    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(_adam(model))
    train_smp(smp, model, opt, lm_train_step(smp), steps, GLOBAL_BATCH)
    return {"model": model.local_state_dict(), "own": opt.local_state_dict(), "gathered": opt.local_state_dict(gather_if_shard=1)}


def _resume_from(saved: dict, steps: int, more: int) -> dict:
    """A new job: every rank loads rdp_rank 0's file, as the script does, and trains ``more`` steps."""
    import smp_compat as smp

    smp.init({"microbatches": 2, "ddp": True, "shard_optimizer_state": True})
    model = smp.DistributedModel(make_model(seed=5))
    opt = smp.DistributedOptimizer(_adam(model))
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["gathered"], 1)  # the script's call: optimizer.load_state_dict(sd, args.gather_if_shard)
    step, per_rank = lm_train_step(smp), GLOBAL_BATCH // smp.dp_size()
    for x, y in make_batches(steps + more, GLOBAL_BATCH)[steps:]:
        opt.zero_grad()
        step(model, *(t[smp.dp_rank() * per_rank : (smp.dp_rank() + 1) * per_rank] for t in (x, y)))
        opt.step()
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


def test_gather_if_shard_saves_every_share_and_a_resume_from_rdp_rank0s_file_continues_exactly() -> None:
    saved = run_ranks(_save_gathered, 2, STEPS, timeout=120)
    names = {n for n, _ in make_model().named_parameters()}
    merged = merge_optimizer_parts([r["own"] for r in saved])
    for r in saved:  # each rank's dict holds both shares: what the other rank's own part holds, bitwise
        gathered = r["gathered"]
        assert {gathered["_smp_param_names"][i] for i in gathered["state"]} == names
        assert gathered["param_groups"] == merged["param_groups"]
        for i, s in merged["state"].items():
            j = gathered["_smp_param_names"].index(merged["_smp_param_names"][i])
            assert all(torch.equal(v, gathered["state"][j][k]) for k, v in s.items())
    resumed = run_ranks(_resume_from, 2, saved[0], STEPS, 2, timeout=120)
    _, ref_state = reference_training(STEPS + 2, GLOBAL_BATCH)
    for r in resumed:
        for name, value in r.items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
