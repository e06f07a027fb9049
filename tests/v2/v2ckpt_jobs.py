"""Rank bodies for the v2 checkpoint tests: a tiny FSDP2 (+ DTensor TP) model saved and resumed the way AWS's
checkpoints.py does it (action ranks, global coordinator ranks, ``process_group`` keywords, tp{T}-{r} folders).

Each ``job`` is one run of ``smp_compat.testing.run_ranks``: new processes, so a resume is a new job, and each
runs in a container of its own (``fresh_home``): a resume never has the saving job's home, key or trust (issue 33).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import smp_compat.v2.checkpoint.utils  # noqa: F401  (first, as the scripts' `import torch.sagemaker.checkpoint.utils`)
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fresh_home import fresh_container

__all__ = ["Layout", "job", "user_content"]

WIDTH, HIDDEN, BATCH = 8, 16, 4


@dataclass(frozen=True)
class Layout:
    """(rep, shard, tp) sizes of the job's mesh: rank = (rep * shard + s) * tp + t, as SMP v2 orders ranks."""

    rep: int
    shard: int
    tp: int = 1

    def mesh(self) -> DeviceMesh:
        """tsm.init with this layout's degrees; its state.device_mesh ("rep", "shard", "cp", "tp")."""
        import smp_compat.v2 as tsm

        tsm.init({"hybrid_shard_degree": self.shard, "tensor_parallel_degree": self.tp})
        return tsm.state.device_mesh


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(layout: Layout, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, DeviceMesh]:
    """The model (same weights on every rank for a seed), TP over "tp", FSDP2 HSDP over ("rep", "shard")."""
    torch.manual_seed(seed)
    model = Net()
    mesh = layout.mesh()
    if layout.tp > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dp_mesh = mesh["rep", "shard"]
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer, mesh


def train(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, steps: range) -> list[float]:
    """Steps on data seeded by (step, data-parallel rank); returns the loss averaged over data-parallel ranks."""
    dp_rank = mesh.get_local_rank("rep") * mesh.size(1) + mesh.get_local_rank("shard")
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def shard_group_metadata(mesh: DeviceMesh) -> tuple[Any, int, bool]:
    """The scripts' checkpointing_pg_metadata: (model.process_group, min global rank of it, rep rank == 0)."""
    group = mesh["shard"].get_group()
    return group, min(dist.get_process_group_ranks(group)), mesh.get_local_rank("rep") == 0


def tp_folder(root: str, mesh: DeviceMesh, layout: Layout) -> str:
    return os.path.join(root, f"tp{layout.tp}-{mesh.get_local_rank('tp')}") if layout.tp > 1 else root


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, layout: Layout,
                 folder: str, extra: dict[str, Any]) -> None:  # fmt: skip
    """As checkpoints.py's sharded save: replica 0 writes over the shard group with a global coordinator."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)} | extra
    group, coordinator, action = shard_group_metadata(mesh)
    if action:
        dcp.save_state_dict(state_dict=state, storage_writer=dcp.FileSystemWriter(tp_folder(folder, mesh, layout)),
                            planner=dcp.DefaultSavePlanner(), process_group=group, coordinator_rank=coordinator)
    dist.barrier()


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, layout: Layout,
                 folder: str, extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """As checkpoints.py's sharded load: model and counters, then load_sharded_optimizer_state_dict."""
    group, coordinator, _ = shard_group_metadata(mesh)
    path = tp_folder(folder, mesh, layout)
    state = {"model": get_model_state_dict(model)} | extra
    dcp.load_state_dict(state_dict=state, storage_reader=dcp.FileSystemReader(path), process_group=group,
                        coordinator_rank=coordinator, planner=dcp.DefaultLoadPlanner())
    model.load_state_dict(state["model"])
    optim = load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key="optimizer",
                                              storage_reader=dcp.FileSystemReader(path), process_group=group)
    set_optimizer_state_dict(model, optimizer, optim["optimizer"])
    return state


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}


def replication_group() -> tuple[Any, int]:
    """As checkpoints.py: a group per state.ranker.get_rep_groups() entry (all ranks create all), this rank's."""
    import smp_compat.v2 as tsm

    mine: tuple[Any, int] = (None, -1)
    for ranks in tsm.state.ranker.get_rep_groups():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = (group, min(ranks))
    return mine


def _local_folder(root: str, mesh: DeviceMesh) -> str:
    return os.path.join(root, f"tp{mesh.get_local_rank('tp')}_ep0_fsdp{mesh.get_local_rank('shard')}")


def save_async(method: str, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, layout: Layout,
               folder: str, extra: dict[str, Any], queue: Any) -> None:  # fmt: skip
    """As checkpoints.py's async_sharded (replica 0 over the shard group) and async_local (every rank, over its
    replication group, SM_LOCAL_STATE_DICT) saves."""
    from smp_compat.v2.distributed.checkpoint.state_dict_saver import async_save
    from smp_compat.v2.distributed.checkpoint.state_dict_utils import SMStateDictType, sm_state_dict_type

    if method == "async_local":
        group, coordinator = replication_group()
        queue.maybe_finalize_async_calls(blocking=True, process_group=group)
        with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()} | extra
        async_save(state, checkpoint_id=_local_folder(folder, mesh), process_group=group,
                   coordinator_rank=coordinator, queue=queue)
        return
    group, coordinator, action = shard_group_metadata(mesh)
    queue.maybe_finalize_async_calls(blocking=True, process_group=group)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)} | extra
    if action:
        async_save(state, checkpoint_id=tp_folder(folder, mesh, layout), process_group=group,
                   coordinator_rank=coordinator, queue=queue)


def load_async(method: str, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, layout: Layout,
               folder: str, extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """As checkpoints.py's async loads: SMP's load + DistributedFileSystemReader; async_local loads in place."""
    from smp_compat.v2.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from smp_compat.v2.distributed.checkpoint.state_dict_loader import load
    from smp_compat.v2.distributed.checkpoint.state_dict_utils import (
        SMStateDictType, init_optim_state, sm_state_dict_type)

    if method == "async_local":
        group, coordinator = replication_group()
        with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
            state = {"model": model.state_dict()} | extra
            init_optim_state(optimizer, skip_empty_param=True)
            state["optimizer"] = optimizer.state_dict()
            load(state_dict=state, process_group=group, coordinator_rank=coordinator,
                 storage_reader=DistributedFileSystemReader(_local_folder(folder, mesh)))
        return state
    group, coordinator, _ = shard_group_metadata(mesh)
    path = tp_folder(folder, mesh, layout)
    state = {"model": get_model_state_dict(model)} | extra
    load(state_dict=state, storage_reader=DistributedFileSystemReader(path), process_group=group,
         coordinator_rank=coordinator, planner=dcp.DefaultLoadPlanner())
    model.load_state_dict(state["model"])
    optim = load_sharded_optimizer_state_dict(model_state_dict=state["model"], optimizer_key="optimizer",
                                              storage_reader=DistributedFileSystemReader(path), process_group=group)
    set_optimizer_state_dict(model, optimizer, optim["optimizer"])
    return state


def user_content(step: int) -> dict[str, Any]:
    """What train_lib.py merges into every checkpoint: counters, the script's arguments, its Hugging Face config."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=WIDTH, intermediate_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2)
    return {"total_steps": step, "note": "v2ckpt", "cli_args": {"lr": 1e-2, "checkpoint_dir": ["/opt/ml/checkpoints"]},
            "model_config": config}  # fmt: skip


def job(kind: str, layout: Layout, folder: str, home: str, seed: int, save_at: int, steps: int,
        method: str = "sharded") -> dict[str, Any]:  # fmt: skip
    """Train ``steps`` steps, checkpointing after ``save_at`` (kind "save"), or resume from the folder (kind "resume"),
    in a container whose home is ``home`` (a resume's is not the save's: no key, nothing exported, no flag).

    ``method``: "sharded", or "async_sharded" / "async_local" (a second save at the last step checks that the
    queue finalizes the first, then the training ends with a blocking finalize).
    """
    key = fresh_container(home)
    model, optimizer, mesh = build(layout, seed)
    if kind == "save":
        first = train(model, optimizer, mesh, range(save_at))
        extra = user_content(save_at)
        if method == "sharded":
            save_sharded(model, optimizer, mesh, layout, folder, extra)
            saved = full_params(model)
            rest = train(model, optimizer, mesh, range(save_at, steps))
        else:
            from smp_compat.v2.distributed.checkpoint.async_utils import AsyncCallsQueue

            queue = AsyncCallsQueue()
            save_async(method, model, optimizer, mesh, layout, folder, extra, queue)
            saved = full_params(model)
            rest = train(model, optimizer, mesh, range(save_at, steps))
            save_async(method, model, optimizer, mesh, layout, folder + "-last", extra, queue)
            queue.maybe_finalize_async_calls(blocking=True, process_group=None)
            assert queue.get_num_unfinalized_calls() == 0
        return {"losses": first + rest, "saved": saved if dist.get_rank() == 0 else None}
    counters: dict[str, Any] = {"total_steps": 0, "note": "", "model_config": None}
    if method == "sharded":
        state = load_sharded(model, optimizer, mesh, layout, folder, counters)
    else:
        state = load_async(method, model, optimizer, mesh, layout, folder, counters)
    loaded = full_params(model)
    done = int(state["total_steps"])
    return {"losses": train(model, optimizer, mesh, range(done, steps)), "done": done, "note": state["note"],
            "config": state["model_config"].to_dict(), "key_made": key.exists(),
            "loaded": loaded if dist.get_rank() == 0 else None}  # fmt: skip
