"""Context parallelism (issue 35 item 1): tsm.transform(model, cp_comm_type=...) equals one-process PyTorch.

Each rank gets the scripts' head/tail chunks of its data-parallel rank's sequences, no position_ids and no
mask; FSDP shards over shard x cp and averages gradients there. fp32, 5 AdamW steps with clipping, against one
process on the unsplit sequences: the mean loss over the world and the final full weights. bf16 (the
scripts' MixedPrecision) is bounded by bf16's own noise against a one-process bf16 reference (_check_bf16).
"""

from __future__ import annotations

import cp_job
import fsdp_job
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.testing import run_ranks
from smp_compat.v2.context_parallel import local_positions, split_for_cp_rank

needs_attention_interface = pytest.mark.skipif(
    not hasattr(__import__("transformers"), "AttentionInterface"),
    reason="context parallelism needs Hugging Face's AttentionInterface (transformers >= 4.48)",
)

BF16 = ("llama", "p2p", {"hybrid_shard_degree": 2, "context_parallel_degree": 2}, True, True)
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # measured: losses <= 1.5e-6, weights <= 1.6e-5 (tp x cp); a wrong shift: ~1e-1


def _relative_step_error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], family: str) -> float:
    """Max over tensors of |params - ref| / max |ref's SGD step|: the error of the step (the gradient) itself."""
    start = cp_job.build(family).state_dict()
    steps = {k: (ref[k] - start[k]).abs().max() for k in ref if k in params and ref[k].is_floating_point()}
    return max(((params[k] - ref[k]).abs().max() / s).item() for k, s in steps.items() if s > 0)


def _check_bf16(got: dict) -> None:
    """cp 2 under MixedPrecision(bf16, bf16, fp32 buffers), one SGD step, against one process in bf16 on the
    unsplit sequences. Not exact: the split changes every bf16 rounding (each rank's matmuls and softmax sums
    cover half the tokens, the two bf16 gradient halves are summed by the reduce-scatter; cp's attention
    blocks accumulate in fp32), so the bound is bf16's own noise, measured: the step's error 1.67e-2 of its
    size against the bf16 reference, 1.68e-2 between the bf16 and fp32 references, 1.3e-5 for cp 2 in fp32.
    The fp32-to-bf16 gap (1.6e-2) shows the run computed in bf16; a wrong shift or a lost gradient half
    is an error of order 1."""
    family = BF16[0]
    assert got["dtypes"] == {torch.float32}  # fp32 masters
    _, ref16 = cp_job.reference_16(family, 1, sgd=True)
    _, ref32 = cp_job.reference(family, 1, sgd=True)
    assert _relative_step_error(got["params"], ref16, family) < 5e-2
    assert _relative_step_error(got["params"], ref32, family) > 1e-3  # the run really computed in bf16


def _check(results: list[dict], runs: list[tuple], world: int) -> None:
    for i, (family, comm, degrees) in enumerate(runs):
        dp = world // (degrees["context_parallel_degree"] * degrees.get("tensor_parallel_degree", 1))
        ref_losses, ref_params = cp_job.reference(family, dp)
        got = results[0][i]
        where = f"{family} {comm} {degrees}"
        diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
        assert diff < LOSS_TOL, f"{where}: mean loss differs from one process by {diff}"
        assert fsdp_job.max_diff(got["params"], ref_params) < PARAM_TOL, where
        # each rank's value is its share: the cp group's mean is the unsplit loss, not each rank's
        assert any(abs(a - b) > 1e-3 for a, b in zip(got["mine"], ref_losses)), where


@pytest.mark.hf
@needs_attention_interface
def test_cp2_world2_both_comm_types_and_families_match_one_process() -> None:
    """fp32 runs to the digit; and a bf16 run (MixedPrecision, one SGD step) within bf16's noise."""
    degrees = {"hybrid_shard_degree": 2, "context_parallel_degree": 2}
    runs = [("llama", "p2p", degrees), ("llama", "all_gather", degrees), ("gpt_neox", "p2p", degrees),
            ("mistral", "all_gather", degrees)]  # fmt: skip
    results = run_ranks(cp_job.several, 2, [*runs, BF16], timeout=600)
    _check(results, runs, 2)
    _check_bf16(results[0][-1])


@pytest.mark.hf
@needs_attention_interface
def test_cp2_with_hybrid_shard_and_tp_world4_match_one_process() -> None:
    runs = [("llama", "all_gather", {"hybrid_shard_degree": 4, "context_parallel_degree": 2}),  # 2 shards x cp 2
            ("mistral", "p2p", {"hybrid_shard_degree": 2, "context_parallel_degree": 2}),  # 2 replicas of cp 2
            ("llama", "p2p", {"hybrid_shard_degree": 2, "context_parallel_degree": 2, "tensor_parallel_degree": 2})]
    _check(run_ranks(cp_job.several, 4, runs, timeout=600), runs, 4)


def _attention_and_loss(comm: str, dtype: torch.dtype) -> list[float]:
    """Both attentions (GQA; float64: plain math, float32: the CPU flash kernels) and the loss with ignored
    labels at chunk seams, against the unsplit computation; returns the max errors (output, dq, dk, dv, loss,
    dlogits)."""
    from smp_compat.v2.context_parallel.attention import CpGroup, context_parallel_attention
    from smp_compat.v2.context_parallel.loss import global_shift_loss

    cp = CpGroup.of(dist.group.WORLD, comm)
    n, r = cp.size, cp.rank
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 8, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
    grad_out = torch.randn(2, 4, 24, 8, dtype=dtype)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    ref.backward(grad_out)
    local = [split_for_cp_rank(t.detach(), n, r, 2).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, 0.3, cp)
    out.backward(split_for_cp_rank(grad_out, n, r, 2))
    errors = [(out - split_for_cp_rank(ref, n, r, 2)).abs().max().item()]
    errors += [(t.grad - split_for_cp_rank(full.grad, n, r, 2)).abs().max().item() for full, t in zip((q, k, v), local)]
    logits = torch.randn(2, 24, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 24))
    labels[:, 4] = labels[0, 11] = labels[1, 0] = -100  # a chunk's first label, a target across a seam, the first
    ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    ref_loss.backward()
    mine_logits = split_for_cp_rank(logits.detach(), n, r).requires_grad_()
    loss = global_shift_loss(mine_logits, split_for_cp_rank(labels, n, r), dist.group.WORLD)
    (loss / n).backward()  # the mean over the cp group, as FSDP's gradient average computes
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    errors += [abs(mean.item() / n - ref_loss.item()),
               (mine_logits.grad - split_for_cp_rank(logits.grad, n, r)).abs().max().item()]
    return errors


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_attention_and_loss_equal_the_unsplit_computation_at_cp3(comm: str, dtype: torch.dtype) -> None:
    for rank, errors in enumerate(run_ranks(_attention_and_loss, 3, comm, dtype, timeout=120)):
        assert max(errors) < 2e-6, f"rank {rank}: {errors}"  # blocks compute in fp32


def test_positions_are_the_head_and_tail_chunks() -> None:
    assert local_positions(2, 0, 4).tolist() == [0, 1, 6, 7]
    assert local_positions(2, 1, 4).tolist() == [2, 3, 4, 5]
    ids = torch.arange(16).view(1, 16)
    assert split_for_cp_rank(ids, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    with pytest.raises(SMPConfigError, match="must be even"):
        local_positions(2, 0, 5)


@pytest.mark.hf
def test_refusals_name_the_feature() -> None:
    from smp_compat.v2.context_parallel.hf import _refuse

    config = cp_job.tp_helpers.config("mistral")
    with pytest.raises(SMPUnsupportedError, match="sliding attention window"):
        _refuse(config)
    config.sliding_window, config.attention_dropout = None, 0.1
    with pytest.raises(SMPUnsupportedError, match="attention dropout"):
        _refuse(config)
