"""Rank bodies for SMP 2.0 - 2.3's model checkpoint helpers (``torch.sagemaker.distributed.fsdp.checkpoint``), saved
and resumed as AWS's HyperPod scripts do for ``--checkpoint_type use_pg_with_util``; the model, data and layouts
are v2ckpt_jobs' (the sharded checkpoint's tests), so the two checkpoint types can read each other's folders."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import StateDictType

from fresh_home import fresh_container
from v2ckpt_jobs import BATCH, Layout, build, full_params, load_sharded, shard_group_metadata, train

__all__ = ["util_job", "EXPORTS"]

EXPORTS = ("resume_from_sequence_number", "start_train_path_index", "total_steps")  # checkpoints.py's _EXPORT_KEYS


def _train(model: Any, optimizer: Any, scheduler: Any, mesh: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses += train(model, optimizer, mesh, range(step, step + 1))
        scheduler.step()
    return losses


def util_job(kind: str, layout: Layout, folder: str, home: str, seed: int, save_at: int, steps: int,
             loader: str = "util") -> dict[str, Any]:  # fmt: skip
    """Train and save with ``save_model_checkpoint`` after ``save_at`` steps (kind "save"), or resume (kind
    "resume") with ``load_model_checkpoint`` (loader "util") or the scripts' sharded load (loader "sharded")."""
    from smp_compat.v2.distributed.fsdp import checkpoint as tsm_fsdp_checkpoint

    fresh_container(home)
    model, optimizer, mesh = build(layout, seed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    metadata = shard_group_metadata(mesh)
    sharded = StateDictType.SHARDED_STATE_DICT
    if kind == "save":
        first = _train(model, optimizer, scheduler, mesh, range(save_at))
        exports = {"resume_from_sequence_number": save_at * BATCH, "start_train_path_index": 0, "total_steps": save_at}
        tsm_fsdp_checkpoint.save_model_checkpoint(model, sharded, folder, None, metadata, log=dist.get_rank() == 0,
                                                  optimizer=optimizer, scheduler=scheduler, extra_exports=exports)
        dist.barrier()
        saved = full_params(model)
        rest = _train(model, optimizer, scheduler, mesh, range(save_at, steps))
        return {"losses": first + rest, "saved": saved if dist.get_rank() == 0 else None,
                "lr": optimizer.param_groups[0]["lr"]}
    if loader == "util":
        loaded = tsm_fsdp_checkpoint.load_model_checkpoint(
            model, sharded, folder, None, metadata, log=dist.get_rank() == 0, optimizer=optimizer,
            scheduler=scheduler, extra_imports={key: 0 for key in EXPORTS})
        assert loaded[tsm_fsdp_checkpoint.EXPORT_KEY_MODEL] is model
        assert loaded[tsm_fsdp_checkpoint.EXPORT_KEY_OPTIMIZER] is optimizer
        assert loaded[tsm_fsdp_checkpoint.EXPORT_KEY_SCHEDULER] is scheduler
        counters = dict(loaded[tsm_fsdp_checkpoint.EXPORT_KEY_IDENTITY])
        assert counters.pop("epoch") == 0  # AWS's scripts read an epoch they never export (SMP's identity had one)
    else:
        counters = load_sharded(model, optimizer, mesh, layout, folder,
                                {"scheduler": scheduler.state_dict(), **{key: 0 for key in EXPORTS}})
        scheduler.load_state_dict(counters.pop("scheduler"))
        counters = {key: counters[key] for key in EXPORTS}
    loaded_params = full_params(model)
    done = int(counters["total_steps"])
    return {"losses": _train(model, optimizer, scheduler, mesh, range(done, steps)), "counters": counters,
            "lr": optimizer.param_groups[0]["lr"], "loaded": loaded_params if dist.get_rank() == 0 else None}
