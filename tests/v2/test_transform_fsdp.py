"""The scripts' fine-tuning path at tp 2 x shard 2 (world 4) trains as one process of plain PyTorch.

Only rank 0 holds the weights; the others build on meta. AWS's train_lib.py then calls
``transform(load_state_dict_from_rank0=True)`` (rank 0's tp peer gets its weights), ``DelayedParamIniter`` on
ranks other than 0, and ``FullyShardedDataParallel(..., sync_module_states=True, param_init_fn, post_param_init_fn)``
with the ``TransformerLayer`` wrap policy (the other tp group gets them from its data-parallel source), then
REENTRANT activation checkpointing, ``offload_wrapper``, AdamW with two groups, ``clip_grad_norm_`` and the
final FULL_STATE_DICT save. (Every rank building the model: tests/v2/test_fsdp_tp.py.)
"""

from __future__ import annotations

from typing import Any

import fsdp_job
import pytest
import torch
import torch.distributed as dist

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf

TOL = 1e-4  # float noise at tp 2 is ~1e-5 after 5 AdamW steps; a wrong split or reduction moves weights ~1e-2


def _job() -> dict[str, Any]:
    import torch.sagemaker as tsm
    from torch.sagemaker.delayed_param import DelayedParamIniter
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    fsdp_job.init_v2(2, tp=2)
    rank = dist.get_rank()
    model = tsm.transform(fsdp_job.tiny_llama(meta=rank != 0), load_state_dict_from_rank0=True)
    initer = DelayedParamIniter(model) if rank != 0 else None
    model = fsdp_job.wrap_as_scripts(model, strategy="hybrid_shard", layer=TransformerLayer, sync_module_states=True,
                                     param_init_fn=initer and initer.get_param_init_fn(),
                                     post_param_init_fn=initer and initer.get_post_param_init_fn())  # fmt: skip
    opt = fsdp_job.adamw(model)
    losses = fsdp_job.train_steps(model, opt, tsm.state.dp_rank, range(fsdp_job.STEPS))
    return {"losses": losses, "params": fsdp_job.full_params(model), "dp": (tsm.state.dp_rank, tsm.state.tp_rank)}


def test_tp2_shard2_fine_tuning_from_rank0_weights() -> None:
    results = run_ranks(_job, 4, timeout=240)
    assert [r["dp"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref_losses, ref_params = fsdp_job.reference_training(dp=2)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    params = results[0]["params"]
    assert params.keys() == ref_params.keys()  # Hugging Face names
    assert all(type(v) is torch.Tensor for v in params.values())  # whole tensors, not DTensors
    assert fsdp_job.max_diff(params, ref_params) < TOL
    assert all(r["params"] == {} for r in results[1:])
