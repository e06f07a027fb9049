"""Cutting one plain state dict into partial parts for a job at other degrees (``smp-compat checkpoint split``):
which pipeline rank owns each entry (from a partition plan, or balanced by size), then the part files."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from smp_compat.checkpoints import folders, signing, state_dicts
from smp_compat.checkpoints.convert import load_file
from smp_compat.checkpoints.serialization import atomic_save, atomic_write
from smp_compat.errors import CheckpointError

__all__ = ["read_plan", "split_model", "module_owners", "write_checkpoint_parts", "write_save_parts"]


def read_plan(source: str | os.PathLike[str]) -> dict[str, Any]:
    """A partition plan: JSON (``PartitionPlan.to_dict()`` or ``{"assignment": ...}``), or a checkpoint's config."""
    path = Path(source)
    if path.is_dir():
        folder = path if (path / folders.CONFIG_FILE).is_file() else folders.checkpoint_folder(path, None)
        path = folder / folders.CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"Partition plan source {str(source)!r} does not exist.")
    if path.suffix == ".json":
        try:
            plan = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"Cannot read the partition plan {path}: {exc}.") from exc
    else:
        plan = load_file(path).get("partition")
    if not isinstance(plan, Mapping) or not isinstance(plan.get("assignment"), Mapping):
        raise CheckpointError(
            f"{path} has no partition plan (a dict with an 'assignment' of module name to pipeline rank). Pass a "
            "plan JSON or a checkpoint saved by smp_compat with pipeline_parallel_degree > 1."
        )
    return dict(plan)


def _owner(key: str, assignment: Mapping[str, int]) -> int | None:
    """The rank of the module that holds the entry (a plan assigns every module that holds state)."""
    rank = assignment.get(key.rpartition(".")[0])
    return None if rank is None else int(rank)


def split_model(sd: Mapping[str, Any], pp: int, plan: Mapping[str, Any] | None = None) -> list[OrderedDict]:
    """Per-pipeline-rank parts of a plain state dict, marked partial; by ``plan``, else balanced by bytes.

    Any split loads (a part saved under another partition is merged on load); the job's own plan
    lets each rank load its part directly.
    """
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise CheckpointError(f"The pipeline degree to split for must be a positive int, got {pp!r}.")
    entries = state_dicts.strip_markers(sd)
    owners = module_owners(entries, pp, plan)
    parts = [OrderedDict() for _ in range(pp)]
    for k, v in entries.items():
        if isinstance(v, torch.Tensor):
            parts[owners[k]][k] = v
        else:
            for part in parts:
                part[k] = v
    info_plan = None
    if plan is not None:
        info_plan = {"assignment": dict(plan["assignment"]), "pp_size": pp, "method": plan.get("method", "manual")}
    for part in parts:
        part[state_dicts.PARTIAL_KEY] = True
        part[state_dicts.LOAD_INFO_KEY] = {"tensor_parallel_degree": 1, "pipeline_parallel_degree": pp,
                                           "partition_info": info_plan}  # fmt: skip
    return parts


def module_owners(entries: Mapping[str, Any], pp: int, plan: Mapping[str, Any] | None) -> dict[str, int]:
    """The pipeline rank of each entry's module: by ``plan``, else contiguous runs of about equal bytes."""
    return _plan_owners(entries, pp, plan) if plan is not None else _balanced_owners(entries, pp)


def _plan_owners(entries: Mapping[str, Any], pp: int, plan: Mapping[str, Any]) -> dict[str, int]:
    assignment = plan["assignment"]
    owners, unplaced = {}, []
    for k, v in entries.items():
        rank = _owner(k, assignment)
        if isinstance(v, torch.Tensor) and (rank is None or not 0 <= rank < pp):
            unplaced.append(k)
        owners[k] = rank if rank is not None else 0
    if unplaced:
        raise CheckpointError(
            f"The partition plan places no module of {unplaced[:8]} on a rank in 0..{pp - 1}. Use the plan of the "
            "job that will load the checkpoint (its smp_config.pt), or split without a plan."
        )
    return owners


def _balanced_owners(entries: Mapping[str, Any], pp: int) -> dict[str, int]:
    """Contiguous runs of modules (in key order) with about equal bytes per rank; a module never split."""
    modules: OrderedDict[str, int] = OrderedDict()
    for k, v in entries.items():
        size = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
        module = k.rpartition(".")[0]
        modules[module] = modules.get(module, 0) + size
    total = sum(modules.values()) or 1
    rank_of, done = {}, 0
    for module, size in modules.items():
        rank_of[module] = min(done * pp // total, pp - 1)
        done += size
    return {k: rank_of[k.rpartition(".")[0]] for k in entries}


def write_checkpoint_parts(grid: list[list[Mapping[str, Any]]], root: str | os.PathLike[str], tag: str,
                           plan: Mapping[str, Any] | None = None, optimizer_grid: list[list[Any]] | None = None,
                           fp16_grid: list[list[Any]] | None = None,
                           user_content: Path | None = None) -> Path:  # fmt: skip
    """A resumable partial checkpoint folder of parts ``grid[pp][tp]`` (optimizer, fp16 too), published atomically.

    ``user_content``: the source checkpoint's user_content file, copied as it is (what the script's resume
    reads back: steps, scheduler state); without one, the folder's user_content is None.
    """
    root = Path(root)
    name = f"{folders.check_tag(tag)}{folders.PARTIAL_SUFFIX}"
    root.mkdir(parents=True, exist_ok=True)
    folders.recover_interrupted(root)
    staging = folders.staging_folder(root, name)
    pp, tp = len(grid), len(grid[0])
    for (pp_rank, tp_rank), part, optimizer in _cells(grid, optimizer_grid):
        atomic_save(part, staging / folders.model_file(pp_rank, tp_rank))
        if optimizer is not None:
            atomic_save(optimizer, staging / folders.optimizer_file(pp_rank, tp_rank))
    for (pp_rank, tp_rank), fp16, _ in _cells(fp16_grid or []):
        atomic_save(fp16, staging / folders.fp16_file(pp_rank, tp_rank))
    if user_content is not None and user_content.is_file():
        data = user_content.read_bytes()  # copied, not unpickled: it may hold objects safe loading refuses
        atomic_write(staging / folders.USER_CONTENT_FILE, lambda handle: handle.write(data))
        _copy_digest(user_content, staging / folders.USER_CONTENT_FILE)
    else:
        atomic_save(None, staging / folders.USER_CONTENT_FILE)
    partition = None
    if plan is not None:
        partition = {"assignment": dict(plan["assignment"]), "pp_size": pp, "method": plan.get("method", "manual")}
    atomic_save({"config": {"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp},
                 "smp_version": "smp_compat (smp-compat checkpoint split)", "tag": tag, "pipeline_parallel_degree": pp,
                 "tensor_parallel_degree": tp, "partition": partition},
                staging / folders.CONFIG_FILE)  # fmt: skip
    folders.publish_folder(root, staging, name)
    return root / name


def _cells(grid: list[list[Any]], other: list[list[Any]] | None = None) -> list[tuple[tuple[int, int], Any, Any]]:
    """((pp, tp), part, the other grid's part or None) for every cell of ``grid[pp][tp]``."""
    return [((pp, tp), part, other[pp][tp] if other else None)
            for pp, row in enumerate(grid) for tp, part in enumerate(row)]  # fmt: skip


def write_save_parts(grid: list[list[Mapping[str, Any]]], base: str | os.PathLike[str]) -> list[Path]:
    """``smp.save`` part files ``{base}_{pp}_{tp}.pt`` from ``grid[pp][tp]`` (load them with ``smp.load(base)``)."""
    paths = []
    for (pp_rank, tp_rank), part, _ in _cells(grid):
        paths.append(Path(f"{base}_{pp_rank}_{tp_rank}.pt"))
        atomic_save(part, paths[-1])
    return paths


def _copy_digest(source: Path, target: Path) -> None:
    """The same bytes keep their keyed digest (still valid: it covers the content only); none is made up."""
    digest = signing.digest_path(source)
    if digest.is_file():
        text = digest.read_bytes()
        atomic_write(signing.digest_path(target), lambda handle: handle.write(text))
