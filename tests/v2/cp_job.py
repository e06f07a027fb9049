"""Context-parallel training the scripts' way, and the one-process reference on the unsplit sequences.

``cp_training`` runs in each forked rank: ``tsm.init`` with the given degrees, ``tsm.transform(model,
cp_comm_type=...)``, the scripts' FSDP call (fsdp_job.wrap_as_scripts: TransformerLayer auto-wrap, REENTRANT
activation checkpointing, ``offload_wrapper``), then per step the data-parallel rank's batch cut by the scripts'
head/tail rule (``split_for_cp_rank``) with no ``position_ids`` and ``attention_mask=None``.
"""

from __future__ import annotations

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


def reference(family: str, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the unsplit sequences: mean loss over the dp ranks' batches, clipping, AdamW."""
    model = build(family)
    opt = fsdp_job.adamw(model)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(fsdp_job._loss(model, fsdp_job.batch(step, r)) for r in range(dp)) / dp
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp_job.CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def cp_training(family: str, comm_type: str, degrees: dict[str, int]) -> dict[str, Any]:
    """One rank's run; returns the world-mean loss per step, this rank's losses, and the full weights (rank 0)."""
    from smp_compat.v2.context_parallel import split_for_cp_rank
    from smp_compat.v2.state import reset

    import smp_compat.v2  # noqa: F401 - the torch.sagemaker finder
    import torch.sagemaker as tsm
    from torch.sagemaker.grad_norm import clip_grad_norm_
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    reset()
    tsm.init(degrees)
    model = fsdp_job.wrap_as_scripts(tsm.transform(build(family), cp_comm_type=comm_type), layer=TransformerLayer)
    opt = fsdp_job.adamw(model)
    cp, cp_rank, dp_rank = tsm.state.cp_size, tsm.state.cp_rank, tsm.state.dp_rank
    mine = []
    for step in range(STEPS):
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
            "params": fsdp_job.full_params(model)}  # fmt: skip


def several(runs: list[tuple[str, str, dict[str, int]]]) -> list[dict[str, Any]]:
    """Several ``cp_training`` jobs one after another in the same ranks (each a fresh tsm.init)."""
    return [cp_training(*run) for run in runs]
