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


def _delayed_init(tp: int) -> dict[str, torch.Tensor]:
    """AWS's pretraining path: every rank builds on meta, ``transform``, then ``DelayedParamIniter`` in FSDP."""
    import torch.sagemaker as tsm
    from torch.sagemaker.delayed_param import DelayedParamIniter
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    fsdp_job.init_v2(dist.get_world_size() // tp, tp=tp)
    torch.manual_seed(1234)  # the scripts' set_seed(args.seed) on every rank
    model = tsm.transform(fsdp_job.tiny_llama(meta=True))
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        model = fsdp_job.wrap_as_scripts(model, layer=TransformerLayer, param_init_fn=initer.get_param_init_fn(),
                                         post_param_init_fn=initer.get_post_param_init_fn())  # fmt: skip
    return fsdp_job.full_params(model)


def test_delayed_initialization_at_tp2_gives_the_weights_of_tp1() -> None:
    """Each tp piece is cut from a whole tensor drawn as at tp 1 (drawn piece by piece, the tp ranks drew the same
    block twice: q_proj's halves were equal, heads duplicated)."""
    (single,) = run_ranks(_delayed_init, 1, 1, timeout=120)
    split = run_ranks(_delayed_init, 4, 2, timeout=240)[0]
    assert single.keys() == split.keys()
    assert fsdp_job.max_diff(single, split) == 0.0
    q = split["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q[: len(q) // 2], q[len(q) // 2 :])


def _gpt_neox_job() -> dict[str, Any]:
    import tp_helpers as th
    import torch.sagemaker as tsm
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    fsdp_job.init_v2(2, tp=2)
    model = fsdp_job.wrap_as_scripts(tsm.transform(th.build("gpt_neox")), layer=TransformerLayer)
    opt = fsdp_job.adamw(model)
    return {"losses": fsdp_job.train_steps(model, opt, tsm.state.dp_rank, range(fsdp_job.STEPS)),
            "params": fsdp_job.full_params(model)}  # fmt: skip


def test_gpt_neox_tp2_shard2_through_the_scripts_fsdp_call() -> None:
    """GPT-NeoX's other shape under the façade: fused per-head qkv, biases (the row-parallel ones replicated
    DTensors that FSDP shards), LayerNorm, parallel residual. Measured: losses 9.5e-7, weights 6.7e-5 (AdamW on
    the biases' tiny gradients)."""
    import tp_helpers as th

    model = th.build("gpt_neox")
    opt = fsdp_job.adamw(model)
    ref_losses = []
    for step in range(fsdp_job.STEPS):  # one process: the mean over the 2 data-parallel ranks' batches
        opt.zero_grad(set_to_none=True)
        total = sum(fsdp_job._loss(model, fsdp_job.batch(step, r)) for r in range(2)) / 2
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp_job.CLIP)
        opt.step()
        ref_losses.append(total.item())
    r0 = run_ranks(_gpt_neox_job, 4, timeout=240)[0]
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    assert fsdp_job.max_diff(r0["params"], model.state_dict()) < 2e-4
