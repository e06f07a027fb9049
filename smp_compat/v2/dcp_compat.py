"""The stock DCP calls SMP v2 scripts make, made to work on stock PyTorch after ``tsm.init()``.

SMP v2 ships a patched PyTorch, and AWS's checkpoints.py calls torch's own DCP functions the way that build
accepts them; on stock PyTorch three calls break (docs/design.md, "v2 checkpoints"):

* ``checkpoint.save_state_dict / load_state_dict(..., process_group=pg, coordinator_rank=min(global ranks of
  pg))``: stock DCP reads ``coordinator_rank`` as a rank *within* ``pg`` and refuses a global one. The wrapper
  translates the global rank to the group rank, and shows DCP the TP-local slices the group holds
  (``distributed.checkpoint.group_view``: one complete checkpoint per ``tp{T}-{r}`` folder, as SMP's).
* ``load_sharded_optimizer_state_dict(..., process_group=pg)``: stock has no ``process_group`` and builds
  FSDP1 ShardedTensors; the FSDP2-backed model's state dict holds DTensors. The wrapper loads over ``pg``
  into a template shaped like the model's DTensors (``distributed.checkpoint.sharded_optim``).
* ``torch.save`` of a local checkpoint and its ``torch.load`` (weights-only by default): see ``signed_files``.

``install()`` puts pass-through wrappers on those torch attributes when ``torch.sagemaker`` is imported (the
scripts import it before ``from torch.distributed.checkpoint.optimizer import ...``). Until ``tsm.init()``
they call the stock function with the arguments unchanged.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.optimizer as dcp_optimizer
import torch.distributed.checkpoint.state_dict_loader as dcp_loader
import torch.distributed.checkpoint.state_dict_saver as dcp_saver

from smp_compat.errors import CheckpointError

__all__ = ["install", "group_rank", "v2_initialized", "STOCK"]

STOCK: dict[str, Callable[..., Any]] = {}
"""The stock functions, by name, as they were before ``install()``."""

_MARK = "__smp_compat_v2_wrapper__"


def v2_initialized() -> bool:
    """Whether ``tsm.init()`` ran in this process (then the wrappers translate)."""
    v2 = sys.modules.get("smp_compat.v2")
    check = getattr(v2, "is_initialized", None)
    return bool(check is not None and check())


def group_rank(process_group: Any, coordinator_rank: int) -> int:
    """SMP's global ``coordinator_rank`` as a rank of ``process_group`` (stock DCP's meaning)."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return coordinator_rank
    members = dist.get_process_group_ranks(process_group)
    if coordinator_rank not in members:
        raise CheckpointError(
            f"coordinator_rank={coordinator_rank} is not a member of the checkpoint's process group (global ranks "
            f"{members}). SMP v2 takes the coordinator as a global rank of that group, e.g. min(its ranks)."
        )
    return members.index(coordinator_rank)


def _undeprecated(stock: Callable[..., Any]) -> tuple[Callable[..., Any], str | None]:
    """torch's function under its ``@deprecated`` wrapper, and the wrapper's message: the wrapper would blame
    this module's line for a call the script makes, so the message is given again at the script's line."""
    message = getattr(stock, "__deprecated__", None)
    return (getattr(stock, "__wrapped__", stock), message) if message else (stock, None)


def _with_group_coordinator(name: str) -> Callable[..., Any]:
    """``save_state_dict`` / ``load_state_dict`` with ``coordinator_rank`` read as a global rank after init."""
    stock, deprecation = _undeprecated(STOCK[name])

    @functools.wraps(STOCK[name])
    def wrapper(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if deprecation:
            warnings.warn(deprecation, FutureWarning, stacklevel=2)
        if not v2_initialized():
            return stock(state_dict, *args, **kwargs)
        from smp_compat.v2.distributed.checkpoint.group_view import copy_back, localize

        group = kwargs.get("process_group")
        if "coordinator_rank" in kwargs:
            kwargs["coordinator_rank"] = group_rank(group, kwargs["coordinator_rank"])
        view = localize(state_dict, group)
        result = stock(view, *args, **kwargs)
        copy_back(state_dict, view)
        return result

    setattr(wrapper, _MARK, True)
    return wrapper


def _sharded_optimizer_loader() -> Callable[..., Any]:
    """``load_sharded_optimizer_state_dict`` that takes SMP's ``process_group`` and DTensor state dicts."""
    stock = STOCK["load_sharded_optimizer_state_dict"]

    @functools.wraps(stock)
    def wrapper(model_state_dict: Any, optimizer_key: str, storage_reader: Any, *args: Any, **kwargs: Any) -> Any:
        if not v2_initialized():
            return stock(model_state_dict, optimizer_key, storage_reader, *args, **kwargs)
        from smp_compat.v2.distributed.checkpoint.sharded_optim import holds_dtensors, load_for_dtensors

        process_group = kwargs.pop("process_group", None)
        if holds_dtensors(model_state_dict):
            return load_for_dtensors(model_state_dict, optimizer_key, storage_reader, *args,
                                     process_group=process_group, **kwargs)  # fmt: skip
        return stock(model_state_dict, optimizer_key, storage_reader, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def install() -> None:
    """Put the wrappers on torch's DCP attributes (idempotent); they pass through until ``tsm.init()``."""
    if STOCK:
        return
    STOCK["save_state_dict"] = dcp_saver.save_state_dict
    STOCK["load_state_dict"] = dcp_loader.load_state_dict
    STOCK["load_sharded_optimizer_state_dict"] = dcp_optimizer.load_sharded_optimizer_state_dict
    save, load = _with_group_coordinator("save_state_dict"), _with_group_coordinator("load_state_dict")
    optim = _sharded_optimizer_loader()
    for module, attr, wrapper in (
        (dcp, "save_state_dict", save), (dcp_saver, "save_state_dict", save),
        (dcp, "load_state_dict", load), (dcp_loader, "load_state_dict", load),
        (dcp, "load_sharded_optimizer_state_dict", optim), (dcp_optimizer, "load_sharded_optimizer_state_dict", optim),
    ):  # fmt: skip
        if not getattr(getattr(module, attr, None), _MARK, False):
            setattr(module, attr, wrapper)
    from smp_compat.v2 import signed_files

    signed_files.install()
