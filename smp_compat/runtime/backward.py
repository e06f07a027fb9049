"""The caller side of the pipelined backward: seed gradients locally, ship remote outputs' gradients to their
owners, and run one more local segment per batch of input gradients they return.

A mixin of ``PipelineEngine`` (engine.py), which provides the state used here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from smp_compat.errors import RemoteError, StepUsageError
from smp_compat.runtime.lockstep import lockstep_replies
from smp_compat.runtime.remote import CallId, CallRecord, Context, Driver, MicrobatchCalls, context
from smp_compat.runtime.tasks import Scheduler

__all__ = ["BackwardSide"]


class BackwardSide:
    """The backward half of ``PipelineEngine`` on the rank that drives a microbatch's backward."""

    rank: int
    scheduler: Scheduler
    lockstep: Any
    _ordered: Any  # OrderedGradients under deterministic_server, else None
    _driving: Driver | None
    _seq: Any
    _step: Any
    _requests: dict[tuple[int, int], Driver]
    _request_owner: dict[tuple[int, int], int]
    _mb_calls: dict[int, MicrobatchCalls]

    if TYPE_CHECKING:

        def _send(self, dst: int, kind: str, meta: dict[str, Any] | None = None,
                  tensors: list[torch.Tensor] = ()) -> None: ...  # fmt: skip

    def send_output_grads(self, record: CallRecord, grads: list[torch.Tensor | None]) -> None:
        """Called from autograd (any thread): ship the gradients of remote outputs to their owner."""
        driver = self._driving
        record.triggered = True
        request = (self.rank, next(self._seq))
        driver.outstanding.add(request)
        self._requests[request] = driver
        self._request_owner[request] = record.owner
        values = [v for v, g in zip(record.out_values, grads) if g is not None]
        meta = {"req": request, "mb": record.microbatch, "values": values}
        self._send(record.owner, "bwd", meta, [g for g in grads if g is not None])

    def backward(self, tensors: list[torch.Tensor], grad_tensors: list[torch.Tensor]) -> None:
        """``model.backward`` inside a microbatch task on pp_rank 0."""
        ctx = context()
        if ctx is None or self._step is None:
            raise StepUsageError("model.backward() must run inside the @smp.step function body.")
        self._step.enter_backward(ctx.task)
        self._drive_backward(ctx, tensors, grad_tensors)

    def _drive_backward(self, ctx: Context, roots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """Local segment, then one more segment per batch of input gradients the owners return."""
        driver = Driver(ctx.task)
        self._segment(driver, roots, grads)
        if self.lockstep is not None:
            ready_replies = lockstep_replies(ctx.task, driver, self.rank)
        else:
            ready_replies = _in_request_order if self._ordered is not None else _arrived
        while driver.outstanding:
            ready = ready_replies(driver)
            if not ready:
                driver.waiting = True
                self.scheduler.block(ctx.task, f"gradients from {self._pending_owners(driver)}")
                driver.waiting = False
                continue
            roots, grads = [], []
            for request in sorted(ready):
                driver.outstanding.discard(request)
                reply = driver.replies.pop(request)
                if reply.kind == "bwd_err":
                    raise RemoteError(f"backward failed on rank {reply.src}:\n{reply.meta['error']}",
                                      reply.meta.get("root"))  # fmt: skip
                for (call_id, _, i), g in zip(reply.meta["inputs"], reply.tensors):
                    t = self._record(call_id).grad_inputs[i]
                    if t is not None:
                        roots.append(t)
                        grads.append(g)
            self._segment(driver, roots, grads)
        ctx.task.share = ctx.task.accepts = None  # lockstep: a plain task again

    def _segment(self, driver: Driver, roots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """One local backward; the graph is kept because a later segment may pass through the same nodes."""
        pairs = [(t, g) for t, g in zip(roots, grads) if t.requires_grad]
        if not pairs:
            return
        previous, self._driving = self._driving, driver
        try:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], retain_graph=True)
        finally:
            self._driving = previous

    def _driving_microbatch(self) -> int | None:
        return self._driving.task.microbatch if self._driving is not None else None

    def _pending_owners(self, driver: Driver) -> str:
        return ", ".join(sorted({f"rank {self._request_owner.get(r, '?')}" for r in driver.outstanding}))

    def _record(self, call_id: CallId) -> CallRecord:
        for calls in self._mb_calls.values():
            record = calls.records.get(call_id)
            if record is not None:
                return record
        raise RemoteError(f"rank {self.rank} got gradients for an unknown call {call_id}")


def _arrived(driver: Driver) -> list[tuple[int, int]]:
    """The gradient requests whose replies are here (all of them are consumed by the next segment)."""
    return [r for r in driver.outstanding if r in driver.replies]


def _in_request_order(driver: Driver) -> list[tuple[int, int]]:
    """``deterministic_server``: one reply per segment, in the order the requests went out. Replies taken as
    they arrive are grouped by timing, and the grouping decides how a shared leaf's gradients are summed."""
    first = min(driver.outstanding)
    return [first] if first in driver.replies else []
