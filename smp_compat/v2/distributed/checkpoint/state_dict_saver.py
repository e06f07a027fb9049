"""``torch.sagemaker.distributed.checkpoint.state_dict_saver``: SMP v2's ``async_save`` and ``save``.

Both are DCP's (``dcp.async_save`` / ``dcp.save``) with SMP's arguments: ``coordinator_rank`` is a *global*
rank of ``process_group`` (DCP's coordinator is the group's first rank, which is what the scripts pass:
``min(ranks)``; any other member is refused), and ``queue`` collects the pending save. The background write
talks over its own gloo group with the same ranks (made once per rank set, by those ranks only), so its
planning messages never interleave with the training's collectives on the script's group.
S3 destinations (``s3_region``, ``s3client_config``, ``s3://`` ids) are refused: write to a file system.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from smp_compat.errors import SMPUnsupportedError
from smp_compat.v2.dcp_compat import group_rank
from smp_compat.v2.distributed.checkpoint.async_utils import AsyncCallsQueue, AsyncRequest
from smp_compat.v2.distributed.checkpoint.group_view import localize

__all__ = ["async_save", "save", "maybe_finalize_async_calls", "PyTorchDistSaveShardedStrategy"]

_DEFAULT_QUEUE = AsyncCallsQueue()
_WRITER_GROUPS: dict[tuple[int, ...], Any] = {}


class PyTorchDistSaveShardedStrategy:
    """The ``sharded_strategy`` SMP's ``async_save`` accepts: DCP's file-per-rank writer (the only one here).

    ``backend`` and ``version`` are Megatron's names for it and are kept for the scripts' calls.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, thread_count: int = 1, **_: Any) -> None:
        self.backend, self.version, self.thread_count = backend, version, thread_count


def _refuse_s3(checkpoint_id: Any, s3_region: Any, s3client_config: Any) -> None:
    if s3_region is not None or s3client_config is not None or str(checkpoint_id or "").startswith("s3://"):
        raise SMPUnsupportedError(
            "async_save to S3 (s3_region / s3client_config / an s3:// checkpoint_id) is not supported by "
            "smp_compat; save to a file system path (local or shared) and copy it to S3 afterwards."
        )


def _check_coordinator(process_group: Any, coordinator_rank: int) -> None:
    """DCP coordinates from the group's first rank; SMP's callers name that rank (``min(ranks)``)."""
    if group_rank(process_group, coordinator_rank) != 0:
        raise SMPUnsupportedError(
            f"coordinator_rank={coordinator_rank}: smp_compat's DCP saves coordinate from the process group's "
            "lowest global rank; pass min(ranks of the group), as AWS's scripts do."
        )


def _writer_group(process_group: Any) -> Any:
    """A gloo group with ``process_group``'s ranks for the background write (None: all ranks)."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        ranks = tuple(range(dist.get_world_size()))
    else:
        ranks = tuple(dist.get_process_group_ranks(process_group))
    if ranks not in _WRITER_GROUPS:
        with _named_by_ranks():
            _WRITER_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _WRITER_GROUPS[ranks]


@contextlib.contextmanager
def _named_by_ranks() -> Iterator[None]:
    """Name the member-only group by its ranks alone. Torch names it by its ranks *and how many groups this
    process made*, so members whose histories differ wait under different names forever: async_sharded's
    writers are replica 0 only, and a later member-only group with another rank (async_local's writer, in a
    job that saves both, as HyperPod's adapter does) hung. Each rank set's group is made once (cached above),
    so its name is unique in the process."""
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_hash_ranks_to_str", None)
    if original is None:  # another torch: its own naming
        yield
        return
    c10d._hash_ranks_to_str = _ranks_name
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = original


def _ranks_name(ranks: list[int]) -> str:
    name = "smp_compat.async_save.writer:" + "_".join(map(str, ranks))
    return hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()


def async_save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    queue: AsyncCallsQueue | None = None,
    sharded_strategy: PyTorchDistSaveShardedStrategy | None = None,
    wait_error_handling: bool = True,
    force_check_all_plans: bool = True,
    s3_region: str | None = None,
    s3client_config: Any = None,
) -> AsyncRequest:
    """Start writing ``state_dict`` (copied first, so training may go on) and queue the pending write."""
    del sharded_strategy, wait_error_handling, force_check_all_plans  # one strategy; DCP checks every plan
    _refuse_s3(checkpoint_id, s3_region, s3client_config)
    _check_coordinator(process_group, coordinator_rank)
    view = localize(state_dict, process_group)  # one complete checkpoint per tp folder (group_view)
    call = dcp.async_save(view, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                          process_group=_writer_group(process_group))  # fmt: skip
    request = AsyncRequest(call, str(checkpoint_id or getattr(storage_writer, "path", "")))
    (queue if queue is not None else _DEFAULT_QUEUE).schedule_async_call(request)
    return request


def save(
    state_dict: dict[str, Any],
    *,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_writer: Any = None,
    planner: Any = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    s3_region: str | None = None,
    s3client_config: Any = None,
    **_: Any,
) -> Any:
    """DCP's ``save`` with SMP's global ``coordinator_rank``; returns DCP's metadata."""
    _refuse_s3(checkpoint_id, s3_region, s3client_config)
    _check_coordinator(process_group, coordinator_rank)
    view = localize(state_dict, process_group)
    return dcp.save(view, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                    process_group=process_group)  # fmt: skip


def maybe_finalize_async_calls(blocking: bool = False, process_group: Any = None, skip_sync: bool = False) -> list[int]:
    """Finalize the saves ``async_save`` queued without a ``queue`` of the caller's."""
    return _DEFAULT_QUEUE.maybe_finalize_async_calls(blocking=blocking, process_group=process_group,
                                                     skip_sync=skip_sync)  # fmt: skip
