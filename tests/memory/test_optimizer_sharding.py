"""shard_optimizer_state (ZeRO-1 over data parallelism): same training, about 1/dp optimizer state per rank."""

from __future__ import annotations

import pytest
import torch

from models import lm_train_step, make_model, place_blocks_by_stage, reference_training, train_smp
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH = 3, 8


def _train(pp: int, shard: bool) -> dict:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "ddp": True, "shard_optimizer_state": shard,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    model = smp.DistributedModel(make_model())
    if pp > 1:
        place_blocks_by_stage(smp, model)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    train_smp(smp, model, opt, lm_train_step(smp), STEPS, GLOBAL_BATCH)
    state_elems = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
    local_elems = sum(p.numel() for p in model.local_parameters())
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()},
            "state_fraction": state_elems / (2 * local_elems)}  # fmt: skip


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
