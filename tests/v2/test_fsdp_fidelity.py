"""The scripts' FSDP call after tsm.init trains as one-process PyTorch at every hybrid_shard_degree (issue 34, 4).

Each layout runs AWS's call sequence (fsdp_job.py) for 5 steps in fp32 on a tiny Llama and is compared with
the same training in one process, step by step (mean loss over the data-parallel ranks) and on the final
full state dict the scripts save (FULL_STATE_DICT, rank0_only, offload_to_cpu). A wrong reduction (a lost
replica all-reduce, as stock FSDP1 at hybrid shard 1) moves the weights by ~1e-2; float noise is ~3e-7.
"""

from __future__ import annotations

from typing import Any

import fsdp_job
import pytest
import torch
import torch.distributed as dist

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf

TOL = 1e-5

# (world, hybrid_shard_degree, script's sharding_strategy, LOCAL_WORLD_SIZE) -> (group size, shards, strategy)
LAYOUTS = {
    "hsd2-world2-cpu_offload": ((2, 2, "hybrid_shard", 2), (2, 2, "HYBRID_SHARD")),
    "hsd2x2rep-world4": ((4, 2, "full_shard", 4), (2, 2, "HYBRID_SHARD")),
    "hsd1-world4": ((4, 1, "full_shard", 4), (4, 1, "NO_SHARD")),
    "hsd0-full-world4": ((4, 0, "full_shard", 4), (4, 4, "FULL_SHARD")),
    "hsd0-hybrid-node2-world4": ((4, 0, "hybrid_shard", 2), (2, 2, "HYBRID_SHARD")),
}


def _job(h: int, strategy: str, local_world: int, offload: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffload

    fsdp_job.init_v2(h, local_world_size=local_world)
    import torch.sagemaker as tsm

    extra = {"cpu_offload": CPUOffload(offload_params=True)} if offload else {}  # on CPU: where they are already
    model = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama(), strategy=strategy, **extra)
    opt = fsdp_job.adamw(model)
    losses = fsdp_job.train_steps(model, opt, dist.get_rank(), range(fsdp_job.STEPS))
    inner = model._checkpoint_wrapped_module
    return {
        "layout": (model.world_size, inner._smp_fsdp.layout.shard_degree, model.sharding_strategy.name),
        "rank": (model.rank, dist.get_rank(model.process_group)),
        "resolved": tsm.state.resolved_hybrid_shard_degree,
        "action": tsm.state.ranker.get_rep_rank(dist.get_rank()) == 0,
        "losses": losses,
        "params": fsdp_job.full_params(model),
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(name: str) -> None:
    (world, h, strategy, local_world), expected = LAYOUTS[name]
    results = run_ranks(_job, world, h, strategy, local_world, "cpu_offload" in name, timeout=240)
    ref_losses, ref_params = fsdp_job.reference_training(world)
    for r, res in enumerate(results):
        assert res["layout"] == expected, f"rank {r}"
        assert res["rank"][0] == res["rank"][1], f"rank {r}: model.rank is not its rank in model.process_group"
        assert res["params"] == {} or r == 0, f"rank {r}: rank0_only full state dict not empty"
        assert res["resolved"] == expected[0], f"rank {r}: tsm.state's FSDP group size"
        # the scripts' checkpoint writers: replica 0 of every FSDP group (at hybrid shard 1: every rank)
        assert res["action"] == (r < expected[0] or expected[1] == 1), f"rank {r}"
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=0, atol=TOL)
    params = results[0]["params"]
    assert params.keys() == ref_params.keys()  # Hugging Face names: no _fsdp / _checkpoint_wrapped_module parts
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in params.values())
    assert fsdp_job.max_diff(params, ref_params) < TOL
