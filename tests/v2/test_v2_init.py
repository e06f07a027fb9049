"""tsm.init at world 4: state, ranks and process groups for (tp 2, H 2), (H 2), (H 1) and (H 0), on gloo."""

from __future__ import annotations

import json
from typing import Any

import pytest

from smp_compat.testing import run_ranks

CASES = {
    # config -> rank 0..3 as (tp_rank, dp_rank, rep_rank), mesh shape (rep, shard, cp, tp), and per-rank groups
    "tp2_hsd2": ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, (1, 2, 1, 2)),
    "hsd2": ({"hybrid_shard_degree": 2}, (2, 2, 1, 1)),
    "hsd1": ({"hybrid_shard_degree": 1}, (4, 1, 1, 1)),
    "hsd0_tp2": ({"hybrid_shard_degree": 0, "tensor_parallel_degree": 2}, (1, 2, 1, 2)),
    "hsd0": ({"hybrid_shard_degree": 0}, (1, 4, 1, 1)),
}


def _probe(config: dict[str, Any], use_env: bool) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    if use_env:
        os.environ["SM_HP_MP_PARAMETERS"] = json.dumps(config)
    import torch.sagemaker as tsm

    tsm.state.tensor_parallel_degree = 1  # as AWS's scripts write before init: the config must win
    tsm.init(None if use_env else config)
    s, mesh = tsm.state, tsm.state.device_mesh

    def members(group: Any) -> list[int]:
        return sorted(dist.get_process_group_ranks(group))

    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    assert get_global_ranks(s.tp_process_group) == members(s.tp_process_group)
    assert tsm.is_initialized()
    probe = torch.tensor([float(s.rank)])
    dist.all_reduce(probe, group=s.tp_process_group)  # the groups carry traffic, not only names
    return {
        "ranks": (s.rank, s.world_size, s.tp_rank, s.tp_size, s.cp_rank, s.cp_size, s.ep_rank, s.ep_size),
        "dp": (s.dp_rank, s.dp_size),
        "rep_rank": s.ranker.get_rep_rank(s.rank),
        "rep_groups": s.ranker.get_rep_groups(),
        "mesh": (tuple(mesh.mesh.shape), mesh.mesh_dim_names, mesh.device_type),
        "tp": members(s.tp_process_group),
        "tp_sum": probe.item(),
        "hsdp": [members(g) for g in mesh["rep", "shard"].get_all_groups()],
        "rep_rank_group": members(s.rep_rank_process_group),
        "world": members(s.world_process_group),
        "hsd": (s.hybrid_shard_degree, s.resolved_hybrid_shard_degree),
        "tracker": sorted(s.get_rng_state_tracker().get_states()),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_init_builds_state_and_groups_at_world_4(name: str) -> None:
    config, shape = CASES[name]
    results = run_ranks(_probe, 4, config, name == "hsd2", timeout=90)
    rep, shard, cp, tp = shape
    for rank, got in enumerate(results):
        t, dp = rank % tp, rank // tp
        rep_rank = rank // (shard * cp * tp)
        assert got["ranks"] == (rank, 4, t, tp, 0, 1, 0, 1), f"rank {rank}"
        assert got["dp"] == (dp, 4 // tp)
        assert got["mesh"] == ((rep, shard, cp, tp), ("rep", "shard", "cp", "tp"), "cpu")
        assert got["tp"] == [r for r in range(4) if r // tp == rank // tp]
        assert got["tp_sum"] == sum(got["tp"])
        assert got["rep_rank"] == rep_rank
        assert got["rep_groups"] == [[r for r in range(4) if r % (shard * tp) == k] for k in range(shard * tp)]
        assert got["rep_rank_group"] == [r for r in range(4) if r // (shard * tp) == rep_rank]
        assert got["world"] == [0, 1, 2, 3]
        assert got["tracker"] == ["model-parallel-rng"]
        # the HSDP (rep, shard) sub-mesh: this rank's shard group and replicate group
        shard_group = [r for r in range(4) if r // (shard * tp) == rep_rank and r % tp == t]
        replicas = [r for r in range(4) if r % (shard * tp) == rank % (shard * tp)]
        assert got["hsdp"] == [replicas, shard_group], f"rank {rank}: {got['hsdp']}"
    hsd = config["hybrid_shard_degree"]
    resolved = None if hsd == 0 and tp == 1 else shard * cp
    assert results[0]["hsd"] == (hsd, resolved)


def _rng_probe() -> list[float]:
    import torch

    from smp_compat.errors import SMPConfigError

    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": 2, "random_seed": 7})
    tsm.init({"tensor_parallel_degree": 2, "random_seed": 7})  # the same config again: nothing happens
    for late in (lambda: setattr(tsm.state, "tensor_parallel_degree", 1), lambda: tsm.init({"random_seed": 8})):
        try:
            late()
        except SMPConfigError:
            pass
        else:
            raise AssertionError("a change after tsm.init() was accepted")
    torch.manual_seed(0)
    tracker = tsm.state.get_rng_state_tracker()
    with tracker.fork():
        inside = torch.rand(2).tolist()
    outside = torch.rand(1).tolist()
    return inside + outside


def test_rng_tracker_is_seeded_random_seed_plus_tp_rank() -> None:
    import torch

    results = run_ranks(_rng_probe, 2, timeout=60)
    for tp_rank, got in enumerate(results):
        torch.manual_seed(7 + tp_rank)
        inside = torch.rand(2).tolist()
        torch.manual_seed(0)
        assert got == pytest.approx(inside + torch.rand(1).tolist(), abs=0), f"tp rank {tp_rank}"
