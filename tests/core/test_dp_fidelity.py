"""Data parallelism (pp = 1) trains exactly like plain PyTorch on the global batch."""

from __future__ import annotations

import torch

from models import lm_train_step, make_model, reference_training, train_smp
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH = 3, 16


def _train_dp(microbatches: int, steps: int = STEPS, global_batch: int = GLOBAL_BATCH) -> tuple[list[float], dict]:
    import smp_compat as smp

    smp.init({"microbatches": microbatches, "ddp": True})
    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    losses = train_smp(smp, model, opt, lm_train_step(smp), steps, global_batch)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_matches_reference(results: list[tuple[list[float], dict]]) -> None:
    ref_losses, ref_params = reference_training(STEPS, GLOBAL_BATCH)
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert params.keys() == ref_params.keys()
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_dp2_microbatches4_matches_single_process() -> None:
    _assert_matches_reference(run_ranks(_train_dp, 2, 4, timeout=90))


def test_single_process_microbatches2_matches_reference() -> None:
    _assert_matches_reference(run_ranks(_train_dp, 1, 2, timeout=60))
