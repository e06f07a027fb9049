"""Tensor parallelism under the FSDP façade: ``tsm.transform`` then the scripts' FSDP call (issue 34, 4 and 5).

tp 2 x hybrid shard 2 (world 4) and tp 2 alone (world 2) train the scripts' way (auto-wrap and activation
checkpointing on SMP's ``TransformerLayer``, clipping with ``clip_grad_norm_`` over FSDP shards and tp
pieces) and equal one-process PyTorch on the same data-parallel batches (the ranks of a tp group share one).
The clipping norm the script sees (2 and inf) is the one-process norm. FSDP shards the tp pieces over the (rep, shard)
dims of the same root mesh, so the full state dict is whole Hugging Face tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsdp_job
import pytest
import torch
import torch.distributed as dist

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf

TOL = 1e-4  # AdamW turns float-order noise in tiny tp gradients into steps of ~1e-5 (a wrong reduction: ~1e-2)


def _job(h: int) -> dict[str, Any]:
    fsdp_job.init_v2(h, tp=2)
    import torch.sagemaker as tsm
    from torch.sagemaker.grad_norm import clip_grad_norm_
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    # each rank starts from its own weights: transform takes tp rank 0's, sync_module_states dp rank 0's
    model = tsm.transform(fsdp_job.tiny_llama(seed=dist.get_rank()))
    model = fsdp_job.wrap_as_scripts(model, layer=TransformerLayer, sync_module_states=True)
    opt = fsdp_job.adamw(model)
    dp_rank, losses, norms = tsm.state.dp_rank, [], []
    for step in range(fsdp_job.STEPS):
        opt.zero_grad(set_to_none=True)
        ids = fsdp_job.batch(step, dp_rank)
        loss = model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
        loss.backward()
        largest = clip_grad_norm_(model, 1e9, norm_type=float("inf")).item()  # a scale of 1.0: changes nothing
        norms.append((clip_grad_norm_(model, fsdp_job.CLIP).item(), largest))
        opt.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    return {"losses": (stacked / dist.get_world_size()).tolist(), "norms": norms,
            "group": sorted(dist.get_process_group_ranks(model.process_group)),
            "params": fsdp_job.full_params(model)}  # fmt: skip


def _reference_norms(dp: int) -> list[tuple[float, float]]:
    model = fsdp_job.tiny_llama()
    opt = fsdp_job.adamw(model)
    norms = []
    for step in range(fsdp_job.STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(fsdp_job._loss(model, fsdp_job.batch(step, r)) for r in range(dp)) / dp
        loss.backward()
        largest = max(p.grad.abs().max().item() for p in model.parameters())
        norms.append((torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp_job.CLIP).item(), largest))
        opt.step()
    return norms


@pytest.mark.parametrize("world", [4, 2], ids=["tp2xhsd2-world4", "tp2-world2"])
def test_tp_under_fsdp_matches_one_process(world: int, tmp_path: Path) -> None:
    results = run_ranks(_job, world, world // 2, timeout=300)
    dp = world // 2
    ref_losses, ref_params = fsdp_job.reference_training(dp)
    r0 = results[0]
    # the FSDP group: the tp rank's shard group (ranks 0, 2 at tp 2 x shard 2), never its tp peer
    assert [r["group"] for r in results] == ([[0, 2], [1, 3], [0, 2], [1, 3]] if world == 4 else [[0], [1]])
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    # the weights drift by float noise (below), so the gradients' largest entry does too; a norm that missed a tp
    # piece or counted a replica twice is off by far more
    torch.testing.assert_close(torch.tensor(r0["norms"]), torch.tensor(_reference_norms(dp)), rtol=1e-4, atol=0)
    assert r0["params"].keys() == ref_params.keys()
    assert all(type(v) is torch.Tensor for v in r0["params"].values())
    assert fsdp_job.max_diff(r0["params"], ref_params) < TOL
    # the scripts' final save (pytorch_model.bin + config) is a checkpoint stock transformers loads
    torch.save(r0["params"], tmp_path / "pytorch_model.bin")
    fsdp_job.tiny_llama().config.save_pretrained(tmp_path)
    loaded = type(fsdp_job.tiny_llama()).from_pretrained(tmp_path)
    assert fsdp_job.max_diff(loaded.state_dict(), r0["params"]) == 0.0
