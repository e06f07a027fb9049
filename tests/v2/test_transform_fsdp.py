"""tsm.transform + the scripts' FSDP call at tp 2 x shard 2 (world 4) trains as one process of plain PyTorch.

The full sequence of AWS's train_lib.py after ``tsm.init``: ``transform``, ``FullyShardedDataParallel(...)``
with the ``TransformerLayer`` wrap policy, REENTRANT activation checkpointing on ``TransformerLayer``,
``offload_wrapper``, AdamW with two groups, ``clip_grad_norm_``, the final FULL_STATE_DICT save. Both
starting paths: every rank builds the model, or only rank 0 holds the weights (the fine-tuning path:
``load_state_dict_from_rank0`` + ``DelayedParamIniter`` + ``sync_module_states``).
"""

from __future__ import annotations

import functools
from typing import Any

import fsdp_job
import pytest
import torch
import torch.distributed as dist

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf

TOL = 1e-4  # float noise at tp 2 is ~1e-5 after 5 AdamW steps; a wrong split or reduction moves weights ~1e-2


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return fsdp_job.reference_training(dp=2)


def _job(from_rank0: bool) -> dict[str, Any]:
    import torch.sagemaker as tsm
    from torch.sagemaker.delayed_param import DelayedParamIniter
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    fsdp_job.init_v2(2, tp=2)
    rank = dist.get_rank()
    model = fsdp_job.tiny_llama(meta=from_rank0 and rank != 0)
    model = tsm.transform(model, load_state_dict_from_rank0=from_rank0)
    extra: dict[str, Any] = {}
    if from_rank0:
        initer = DelayedParamIniter(model) if rank != 0 else None
        extra = {"sync_module_states": True, "param_init_fn": initer and initer.get_param_init_fn(),
                 "post_param_init_fn": initer and initer.get_post_param_init_fn()}  # fmt: skip
    model = fsdp_job.wrap_as_scripts(model, strategy="hybrid_shard", layer=TransformerLayer, **extra)
    opt = fsdp_job.adamw(model)
    losses = fsdp_job.train_steps(model, opt, tsm.state.dp_rank, range(fsdp_job.STEPS))
    return {"losses": losses, "params": fsdp_job.full_params(model), "dp": (tsm.state.dp_rank, tsm.state.tp_rank)}


@pytest.mark.parametrize("from_rank0", [False, True], ids=["every-rank-builds", "load-from-rank0"])
def test_tp2_shard2_through_the_scripts_fsdp_call(from_rank0: bool) -> None:
    results = run_ranks(_job, 4, from_rank0, timeout=240)
    assert [r["dp"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref_losses, ref_params = _reference()
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    params = results[0]["params"]
    assert params.keys() == ref_params.keys()  # Hugging Face names
    assert all(type(v) is torch.Tensor for v in params.values())  # whole tensors, not DTensors
    assert fsdp_job.max_diff(params, ref_params) < TOL
    assert all(r["params"] == {} for r in results[1:])
