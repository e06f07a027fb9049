"""Pipeline parallelism trains exactly like plain PyTorch on the global batch (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch

from models import lm_train_step, make_model, place_blocks_by_stage, reference_training, train_smp
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH = 3, 8


def _train_pipeline(config: dict, manual: bool) -> dict:
    import smp_compat as smp

    smp.init(config)
    model = smp.DistributedModel(make_model())
    if manual:
        place_blocks_by_stage(smp, model)  # non-contiguous: rank 0 -> later ranks -> rank 0 (tied head)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    losses = train_smp(smp, model, opt, lm_train_step(smp), STEPS, GLOBAL_BATCH)
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"losses": losses, "params": params, "pp_rank": smp.pp_rank()}


def _check(results: list[dict]) -> None:
    ref_losses, ref_state = reference_training(STEPS, GLOBAL_BATCH)
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        merged.update(r["params"])
    ref_params = {n: v for n, v in make_model().named_parameters()}  # names only
    assert set(merged) == set(ref_params)
    for name in ref_params:
        torch.testing.assert_close(merged[name], ref_state[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _config(pp: int, mb: int, pipeline: str, auto: bool, **extra: object) -> dict:
    cfg = {"pipeline_parallel_degree": pp, "microbatches": mb, "pipeline": pipeline, "auto_partition": auto}
    if not auto:
        cfg["default_partition"] = 0
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
@pytest.mark.parametrize("mb", [1, 2, 4])
def test_pp2_manual_matches_single_process(mb: int, pipeline: str) -> None:
    _check(run_ranks(_train_pipeline, 2, _config(2, mb, pipeline, auto=False), True, timeout=90))


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_pp2_auto_matches_single_process(pipeline: str) -> None:
    _check(run_ranks(_train_pipeline, 2, _config(2, 4, pipeline, auto=True), False, timeout=90))


@pytest.mark.parametrize(("mb", "pipeline", "auto"), [(4, "interleaved", False), (2, "simple", True)])
def test_pp3_matches_single_process(mb: int, pipeline: str, auto: bool) -> None:
    _check(run_ranks(_train_pipeline, 3, _config(3, mb, pipeline, auto=auto), not auto, timeout=120))


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_pp2_dp2_matches_single_process(placement: str) -> None:
    cfg = _config(2, 2, "interleaved", auto=False, ddp=True, placement_strategy=placement)
    _check(run_ranks(_train_pipeline, 4, cfg, True, timeout=120))


def test_pp2_over_process_group_channels_matches_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # ranks on one host talk through shared memory by default; the gloo channels (between hosts) stay exact
    monkeypatch.setenv("SMP_COMPAT_SHARED_MEMORY", "0")
    _check(run_ranks(_train_pipeline, 2, _config(2, 4, "interleaved", auto=False), True, timeout=90))


def _train_pipeline_tiny_rings(config: dict, manual: bool) -> dict:
    from smp_compat.runtime import local_links

    local_links.RING_BYTES = 8192  # every message chunked, rings full and wrapping all the time
    return _train_pipeline(config, manual)


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_through_tiny_shared_memory_rings_matches_single_process(pp: int) -> None:
    _check(run_ranks(_train_pipeline_tiny_rings, pp, _config(pp, 4, "interleaved", auto=False), True, timeout=120))
