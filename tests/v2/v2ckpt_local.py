"""checkpoints.py's ``local`` type through the FSDP façade: per-rank ``torch.save`` under LOCAL_STATE_DICT (with
the Hugging Face config in the user content) and, in a new job in a fresh container (another home: the saving job's
key is gone, so its digests verify nothing), ``load_with_process_group`` + plain ``torch.load``."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import fsdp_job
from fresh_home import fresh_container

__all__ = ["local_job"]


def local_job(kind: str, folder: str, home: str, save_at: int, steps: int) -> dict[str, Any]:
    key = fresh_container(home)
    import torch.sagemaker.checkpoint.utils  # noqa: F401  (as checkpoints.py, before torch's checkpoint imports)
    from torch.distributed._shard.api import load_with_process_group
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    fsdp_job.init_v2(2)
    import torch.sagemaker as tsm

    model = fsdp_job.wrap_as_scripts(fsdp_job.tiny_llama(seed=0 if kind == "save" else 5))
    optimizer = fsdp_job.adamw(model)
    dp_rank, path = tsm.state.dp_rank, os.path.join(folder, f"{dist.get_rank()}.pt")
    if kind == "save":
        first = fsdp_job.train_steps(model, optimizer, dp_rank, range(save_at))
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "total_steps": save_at,
                     "model_config": next(m.config for m in model.modules() if hasattr(m, "config"))}  # fmt: skip
        os.makedirs(folder, exist_ok=True)
        torch.save(state, path)
        rest = fsdp_job.train_steps(model, optimizer, dp_rank, range(save_at, steps))
        return {"losses": first + rest, "signed": key.is_file()}
    with load_with_process_group(model.process_group):
        state = torch.load(path)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    done = state["total_steps"]
    return {"losses": fsdp_job.train_steps(model, optimizer, dp_rank, range(done, steps)), "done": done,
            "config": type(state["model_config"]).__name__, "key_made": key.exists()}
