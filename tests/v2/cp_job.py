"""Context-parallel training the scripts' way, and the one-process reference on the unsplit sequences.

``cp_training`` runs in each forked rank: ``tsm.init`` with the given degrees, ``tsm.transform(model,
cp_comm_type=...)``, the scripts' FSDP call (fsdp_job.wrap_as_scripts: TransformerLayer auto-wrap, REENTRANT
activation checkpointing, ``offload_wrapper``), then per step the data-parallel rank's batch cut by the scripts'
head/tail rule (``split_for_cp_rank``) with no ``position_ids`` and ``attention_mask=None``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import fsdp_job
import tp_helpers
import torch
import torch.distributed as dist
from torch import nn

STEPS = fsdp_job.STEPS


def build(family: str, seed: int = 0) -> nn.Module:
    """The tiny model of ``family`` with full attention (Mistral without its sliding window, as cp requires)."""
    import transformers

    config = tp_helpers.config(family)
    if family == "mistral":
        config.sliding_window = None
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def _optimizer(model: nn.Module, sgd: bool) -> torch.optim.Optimizer:
    """AdamW, or (``sgd``) plain SGD at lr 1 so that one step's weight change is the clipped gradient itself:
    AdamW's first step is ~lr * sign(grad) and would turn bf16 rounding of tiny gradients into lr-sized jumps."""
    return torch.optim.SGD(model.parameters(), lr=1.0) if sgd else fsdp_job.adamw(model)


def reference(family: str, dp: int, sgd: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the unsplit sequences: mean loss over the dp ranks' batches, clipping, AdamW (or one
    SGD step)."""
    model = build(family)
    opt = _optimizer(model, sgd)
    losses = []
    for step in range(1 if sgd else STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(fsdp_job._loss(model, fsdp_job.batch(step, r)) for r in range(dp)) / dp
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp_job.CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def reference_16(family: str, dp: int, sgd: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process doing what MixedPrecision(bf16, bf16, fp32 buffers) does on the unsplit sequences: fp32
    masters and AdamW, each data-parallel rank's forward and backward on a bf16 copy, the bf16 gradients summed,
    divided by ``dp``, then fp32 clipping and step."""
    master = build(family)
    opt = _optimizer(master, sgd)
    losses = []
    for step in range(1 if sgd else STEPS):
        work = copy.deepcopy(master)
        for p in work.parameters():
            p.data = p.data.to(torch.bfloat16)
        grads, step_losses = None, []
        for r in range(dp):
            work.zero_grad(set_to_none=True)
            loss = fsdp_job._loss(work, fsdp_job.batch(step, r))
            loss.backward()
            step_losses.append(loss.float().item())
            mine = [p.grad for p in work.parameters()]
            grads = mine if grads is None else fsdp_job._add(grads, mine)
        for p, g in zip(master.parameters(), grads):
            p.grad = (g / dp).float()
        torch.nn.utils.clip_grad_norm_(master.parameters(), fsdp_job.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / dp)
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def cp_training(
    family: str, comm_type: str, degrees: dict[str, int], bf16: bool = False, sgd: bool = False
) -> dict[str, Any]:
    """One rank's run; returns the world-mean loss per step, this rank's losses, and the full weights (rank 0).
    ``bf16``: the scripts' MixedPrecision(bf16, bf16, fp32 buffers); ``sgd``: one SGD step (see _optimizer)."""
    from torch.distributed.fsdp import MixedPrecision

    from smp_compat.v2.context_parallel import split_for_cp_rank
    from smp_compat.v2.state import reset

    import smp_compat.v2  # noqa: F401 - the torch.sagemaker finder
    import torch.sagemaker as tsm
    from torch.sagemaker.grad_norm import clip_grad_norm_
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    reset()
    tsm.init(degrees)
    mixed = MixedPrecision(torch.bfloat16, torch.bfloat16, torch.float32) if bf16 else None
    model = tsm.transform(build(family), cp_comm_type=comm_type)
    model = fsdp_job.wrap_as_scripts(model, mixed=mixed, layer=TransformerLayer)
    opt = _optimizer(model, sgd)
    cp, cp_rank, dp_rank = tsm.state.cp_size, tsm.state.cp_rank, tsm.state.dp_rank
    mine = []
    for step in range(1 if sgd else STEPS):
        opt.zero_grad(set_to_none=True)
        ids = split_for_cp_rank(fsdp_job.batch(step, dp_rank), cp, cp_rank)
        loss = model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
        loss.backward()
        clip_grad_norm_(model, fsdp_job.CLIP)
        opt.step()
        mine.append(loss.detach())
    stacked = torch.stack(mine)
    world = stacked.clone()
    dist.all_reduce(world)
    return {"losses": (world / dist.get_world_size()).tolist(), "mine": stacked.tolist(),
            "params": fsdp_job.full_params(model), "dtypes": {p.dtype for p in model.parameters()}}  # fmt: skip


def several(runs: list[tuple]) -> list[dict[str, Any]]:
    """Several ``cp_training`` jobs one after another in the same ranks (each a fresh tsm.init)."""
    return [cp_training(*run) for run in runs]
