"""AWS's five v2 checkpoint types as checkpoints.py (and SMP's documentation for the async ones) call them on
the FSDP façade: ``sharded``, ``async_sharded``, ``local``, ``async_local`` and ``full``.

``save(kind, model, optimizer, folder, extra)`` writes one checkpoint; ``load(kind, model, optimizer, folder,
extra)`` reads it into a new job's model and optimizer and returns the loaded dict (``extra``'s counters
filled). Folders as the scripts name them: ``tp{T}-{r}`` (sharded types, tp > 1), ``ep{E}-{r}`` (ep > 1),
``tp{t}_ep{e}_fsdp{model.rank}`` (async_local), ``{rank}.pt`` (local), ``pytorch_model.bin`` (full, rank 0).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from v2ckpt_jobs import replication_group

__all__ = ["KINDS", "save", "load", "finalize"]

KINDS = ("sharded", "async_sharded", "local", "async_local", "full")


def _metadata(model: nn.Module) -> tuple[Any, int, bool]:
    """train_lib.py's checkpointing_pg_metadata: (model.process_group, its lowest global rank, replica 0)."""
    import torch.sagemaker as tsm
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    group = model.process_group
    return group, min(get_global_ranks(group)), tsm.state.ranker.get_rep_rank(dist.get_rank()) == 0


def _sharded_folder(folder: str) -> str:
    import torch.sagemaker as tsm

    if tsm.state.tp_size > 1:
        folder = os.path.join(folder, f"tp{tsm.state.tp_size}-{tsm.state.tp_rank}")
    if tsm.state.ep_size > 1:
        folder = os.path.join(folder, f"ep{tsm.state.ep_size}-{tsm.state.ep_rank}")
    return folder


def _local_folder(folder: str, model: nn.Module) -> str:
    import torch.sagemaker as tsm

    return os.path.join(folder, f"tp{tsm.state.tp_rank}_ep{tsm.state.ep_rank}_fsdp{model.rank}")


def save(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, folder: str, extra: dict[str, Any]) -> None:
    """One checkpoint of ``kind``, exactly the calls the scripts make."""
    from torch.distributed import checkpoint
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kind in ("sharded", "async_sharded"):
        group, coordinator, action = _metadata(model)
        if kind == "async_sharded":
            from torch.sagemaker.distributed.checkpoint.state_dict_saver import maybe_finalize_async_calls

            maybe_finalize_async_calls(blocking=True, process_group=group)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            osd = FSDP.optim_state_dict(model, optimizer)
            state = {"model": model.state_dict(), "optimizer": osd} | extra
        if action and kind == "sharded":
            checkpoint.save_state_dict(state_dict=state, storage_writer=checkpoint.FileSystemWriter(
                _sharded_folder(folder)), planner=checkpoint.DefaultSavePlanner(), process_group=group,
                coordinator_rank=coordinator)  # fmt: skip
        elif action:
            from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save

            async_save(state, checkpoint_id=_sharded_folder(folder), process_group=group, coordinator_rank=coordinator)
    elif kind == "local":
        os.makedirs(folder, exist_ok=True)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()} | extra
        torch.save(state, os.path.join(folder, f"{dist.get_rank()}.pt"))
    elif kind == "async_local":
        from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save, maybe_finalize_async_calls
        from torch.sagemaker.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type

        group, coordinator = replication_group()
        maybe_finalize_async_calls(blocking=True, process_group=group)
        with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()} | extra
        async_save(state, checkpoint_id=_local_folder(folder, model), process_group=group,
                   coordinator_rank=coordinator)  # fmt: skip
    else:
        cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
            if dist.get_rank() == 0:
                os.makedirs(folder, exist_ok=True)
                torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    dist.barrier()


def finalize() -> None:
    """The end of the scripts' training: wait for every pending async save."""
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import maybe_finalize_async_calls

    maybe_finalize_async_calls(blocking=True, process_group=None)


def load(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, folder: str,
         extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Read a checkpoint of ``kind`` as the scripts' resume does; ``full``: the weights only (no optimizer)."""
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if kind in ("sharded", "async_sharded"):
        return _load_sharded(kind, model, optimizer, _sharded_folder(folder), extra)
    if kind == "local":
        from torch.distributed._shard.api import load_with_process_group

        with load_with_process_group(model.process_group):
            state = torch.load(os.path.join(folder, f"{dist.get_rank()}.pt"))
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        return state
    if kind == "async_local":
        return _load_async_local(model, optimizer, folder, extra)
    state = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(state)
    return dict(extra)


def _load_sharded(kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, path: str,
                  extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """checkpoints.py's _load_sharded; async_sharded reads through SMP's ``load`` and DistributedFileSystemReader."""
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    group, coordinator, _ = _metadata(model)
    if kind == "sharded":
        reader: Any = checkpoint.FileSystemReader(path)
        read = checkpoint.load_state_dict
    else:
        from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
        from torch.sagemaker.distributed.checkpoint.state_dict_loader import load as read

        reader = DistributedFileSystemReader(path)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()} | extra
        read(state_dict=state, storage_reader=reader, process_group=group, coordinator_rank=coordinator)
        model.load_state_dict(state["model"])
        osd = load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key="optimizer",
                                                storage_reader=reader, process_group=group)  # fmt: skip
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model=model, optim=optimizer,
                                                                optim_state_dict=osd["optimizer"]))  # fmt: skip
    return state


def _load_async_local(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str,
                      extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """SMP's async_local resume: init_optim_state, then ``load`` in place over the replication group."""
    from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from torch.sagemaker.distributed.checkpoint.state_dict_loader import load as read
    from torch.sagemaker.distributed.checkpoint.state_dict_utils import (
        SMStateDictType,
        init_optim_state,
        sm_state_dict_type,
    )

    group, coordinator = replication_group()
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state = {"model": model.state_dict()} | extra
        init_optim_state(optimizer, skip_empty_param=True)
        state["optimizer"] = optimizer.state_dict()
        read(state_dict=state, process_group=group, coordinator_rank=coordinator,
             storage_reader=DistributedFileSystemReader(_local_folder(folder, model)))  # fmt: skip
    return state
