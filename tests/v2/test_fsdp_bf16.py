"""bf16 with the scripts' MixedPrecision(bf16, bf16, fp32 buffers) equals one process doing the same (issue 34).

The reference (fsdp_job.reference_training_16) keeps fp32 master weights and AdamW state, runs each
data-parallel rank's forward and backward on a bf16 copy, sums the bf16 gradients within each shard group and
then across replicas (HSDP's reduce-scatter, then all-reduce), divides and clips in fp32. At 2 shards x 2
replicas the façade matches it to ~1e-8, while the fp32 run differs from it by ~5e-2: the check sees bf16.
"""

from __future__ import annotations

from typing import Any

import fsdp_job
import pytest
import torch
import torch.distributed as dist

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf


def _job() -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecision

    fsdp_job.init_v2(2)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.float32)
    model = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama(), mixed=mp)
    opt = fsdp_job.adamw(model)
    losses = fsdp_job.train_steps(model, opt, dist.get_rank(), range(fsdp_job.STEPS))
    dtypes = {p.dtype for p in model.parameters()} | {v.dtype for s in opt.state.values() for v in s.values()}
    return {"losses": losses, "params": fsdp_job.full_params(model), "dtypes": dtypes,
            "buffers": {b.dtype for b in model.buffers()}}  # fmt: skip


def test_bf16_mixed_precision_matches_one_process_bf16() -> None:
    results = run_ranks(_job, 4, timeout=240)
    ref_losses, ref_params = fsdp_job.reference_training_16(4, 2, torch.bfloat16)
    r0 = results[0]
    assert r0["dtypes"] == {torch.float32} and r0["buffers"] == {torch.float32}  # fp32 masters, moments, buffers
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    assert fsdp_job.max_diff(r0["params"], ref_params) < 1e-5
    _, fp32_params = fsdp_job.reference_training(4)
    assert fsdp_job.max_diff(r0["params"], fp32_params) > 1e-3  # the run really computed in bf16
