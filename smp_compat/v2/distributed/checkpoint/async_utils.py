"""``torch.sagemaker.distributed.checkpoint.async_utils``: the queue of checkpoints still being written.

``async_save`` returns at once and DCP writes in a background thread; the script keeps the queue and calls
``maybe_finalize_async_calls(blocking=True, process_group=pg)`` before the next save and at the end of
training, so a save never overlaps the previous one and no process exits with a write in flight. A write
that failed raises here, as a CheckpointError naming the checkpoint, on the rank where it failed.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.errors import CheckpointError

__all__ = ["AsyncCallsQueue", "AsyncRequest"]


@dataclass
class AsyncRequest:
    """One scheduled save: its DCP future (or AsyncSaveResponse) and the checkpoint it writes."""

    call: Any
    checkpoint_id: str
    idx: int = -1

    def future(self) -> Future[Any]:
        """The future that completes when the files are written (DCP returns one of two shapes)."""
        upload = getattr(self.call, "upload_completion", None)
        return upload if upload is not None else self.call

    def done(self) -> bool:
        return self.future().done()

    def finalize(self) -> None:
        """Wait for the write; a failure becomes a CheckpointError naming the checkpoint."""
        try:
            self.future().result()
        except Exception as exc:  # noqa: BLE001 - re-raised with the checkpoint's name
            raise CheckpointError(
                f"Asynchronous checkpoint {self.checkpoint_id!r} failed to write: {type(exc).__name__}: {exc}"
            ) from exc


class AsyncCallsQueue:
    """Pending asynchronous saves of this rank, finalized in the order they were scheduled."""

    def __init__(self, concurrent_calls: bool = True) -> None:
        self.concurrent_calls = concurrent_calls
        self._calls: list[AsyncRequest] = []
        self._next_idx = 0

    def schedule_async_call(self, request: AsyncRequest) -> int:
        """Queue a started save; returns its index (what ``maybe_finalize_async_calls`` reports)."""
        request.idx = self._next_idx
        self._next_idx += 1
        self._calls.append(request)
        return request.idx

    def maybe_finalize_async_calls(self, blocking: bool = False, process_group: Any = None,
                                   skip_sync: bool = False) -> list[int]:  # fmt: skip
        """Finalize the saves that are done (all of them when ``blocking``); returns their indices.

        Without ``blocking``, the ranks of ``process_group`` (default: all) agree on how many leading saves
        are done, so each rank finalizes the same ones; every rank of the group must call it then.
        ``skip_sync`` (HyperPod's local checkpoints, each rank on its own): no agreement, only this rank's
        leading done saves; with ``blocking`` it changes nothing (no rank talks to another then).
        """
        if blocking:
            count = len(self._calls)
        elif skip_sync:
            count = self._done_here()
        else:
            count = self._agreed_done(process_group)
        finished, self._calls = self._calls[:count], self._calls[count:]
        for request in finished:
            request.finalize()
        return [r.idx for r in finished]

    def _done_here(self) -> int:
        """The number of leading saves done on this rank."""
        count = 0
        while count < len(self._calls) and self._calls[count].done():
            count += 1
        return count

    def _agreed_done(self, process_group: Any) -> int:
        """The number of leading saves done on every rank of the group."""
        count = self._done_here()
        if dist.is_available() and dist.is_initialized():
            agreed = torch.tensor([count], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
            count = int(agreed.item())
        return count

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def close(self) -> None:
        """Wait for every pending save (the end of training)."""
        self.maybe_finalize_async_calls(blocking=True)
