"""Ending a failed step on every rank of the pipeline, so that the next step starts clean.

When the step body raises on pp_rank 0 (its own error, or a served call's error sent back to it), the
other microbatches are mid-flight on every rank: tasks wait for replies, and requests and results sit in
queues. Left there, the next step would resume them: silently wrong outputs, or a hang. So the failing
rank floods an ``abort`` marker carrying its error to its pipeline peers. Every rank that learns of the
failure stops sending work, wakes each of its tasks with ``StepAborted`` so they unwind, sends its own
marker to every peer, and waits for every peer's marker. Channels are ordered, so after the last marker
nothing of the failed step can still arrive. Every rank then drops the step's state and raises the step's
error, so the same ``except`` clause catches it on every rank.

A lost connection or a timeout cannot be ended this way; those leave the engine unusable (``_broken``).
So does a failure with tensor parallelism inside the pipeline: decisions already sent to tp followers
cannot be recalled.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from smp_compat import failure
from smp_compat.errors import RemoteError, SMPTimeoutError, StepUsageError
from smp_compat.runtime.tasks import Fatal, Scheduler, Task
from smp_compat.runtime.messages import Message

__all__ = ["ABORT", "FailedStepSide", "StepAborted"]

ABORT = "abort"
_UNWIND_PRIORITY = (99,)  # the root waits until every unwinding task has run
_TP_PEER_GRACE_S = 2.0  # how long a tp peer's departure waits for this rank to learn of the step's failure


class StepAborted(Exception):
    """Raised inside a task whose step failed on some pipeline rank; it only unwinds the task."""


@dataclass
class _Abort:
    error: BaseException
    origin: int
    markers: set[int] = field(default_factory=set)
    told: bool = False


class FailedStepSide:
    """The failure half of ``PipelineEngine`` (a mixin): end a failed step the same way on every rank."""

    rank: int
    scheduler: Scheduler
    lockstep: Any
    pp_members: list[int]
    _abort: _Abort | None
    _broken: str | None
    _end_step: Any
    _waiting: dict
    _requests: dict
    _request_owner: dict
    _mb_calls: dict
    _hosted: dict
    _releases: dict
    _deferred: list[Message]

    if TYPE_CHECKING:

        def _handle(self, message: Message) -> None: ...

        def _send(self, dst: int, kind: str, meta: dict[str, Any] | None = None,
                  tensors: list[torch.Tensor] = ()) -> None: ...  # fmt: skip

    def _require_usable(self) -> None:
        if self._broken is not None:
            raise StepUsageError(f"the pipeline cannot run another step: {self._broken}")

    def _break(self, why: str) -> None:
        """The failure cannot be ended cleanly: later steps refuse to run (after this one raises)."""
        if self._broken is None:
            self._broken = why

    def _learn_failure(self, error: BaseException, origin: int) -> _Abort:
        """Enter abort mode (the first error learned is the step's error) and wake the root to end the step."""
        if self._abort is None:
            self._abort = _Abort(error, origin)
            self.scheduler.lockstep = None  # tasks now only unwind: no decisions to share with tp peers
        if self.scheduler.root is not None:
            self.scheduler.wake(self.scheduler.root)
        return self._abort

    def _handles_while_aborting(self, message: Message) -> bool:
        """Markers and connection news are handled; the failed step's traffic is dropped. A peer whose marker
        came has ended the step and may already send the next step's work, or have left the job after it:
        that waits for the next step."""
        if message.kind in (ABORT, "transport_error"):
            return True
        if message.src in self._abort.markers:
            self._deferred.append(message)
            return False
        return message.kind == "peer_closed" and message.src in self.pp_members  # tp peers no longer matter

    def _replay_deferred(self) -> None:
        """At the start of a step (the root holds the baton): handle what came early, in arrival order."""
        deferred, self._deferred = self._deferred, []
        for message in deferred:
            self._handle(message)

    def _peer_left(self, src: int) -> None:
        """A peer closed its connection in the middle of a step."""
        if src not in self.pp_members and self._failure_follows():
            return  # a tp peer ended this failed step first and left; the step's error came meanwhile
        self._lose_connection(
            f"rank {src} left the job", f" (it closed its pipeline connection) while rank {self.rank} was in a "
            "step with it: every rank must make the same @smp.step calls (did it return or sys.exit early?).",
            exits=True,
        )

    def _lose_connection(self, what: str, details: str, exits: bool) -> NoReturn:
        """A peer's connection is gone: stop because of the failure (or early exit) behind it when one is
        published, else raise ``what`` + ``details``; the engine refuses later steps."""
        cause = failure.peer_failure(wait=2.0, exits=exits)  # a lost connection usually means a rank failed
        if cause is not None:
            failure.stop_because(cause)
        self._break(what)
        raise RemoteError(what + details)

    def _failure_follows(self, within_s: float = _TP_PEER_GRACE_S) -> bool:
        """A tp peer left in the middle of a step: whether a failure of this step reaches this rank soon after.
        A step that fails on the first stage fails in every tp pipeline, and a peer whose own pipeline learned
        of it first can end it, fail its next step (the engine is broken after a failure under tp) and leave
        before this rank's pipeline peer has told it; that departure must not replace the step's error."""
        deadline = time.monotonic() + within_s
        while self._abort is None and (left := deadline - time.monotonic()) > 0:
            try:
                message = self.scheduler.inbox.get(timeout=left)
            except queue.Empty:
                break
            self._handle(message)
        return self._abort is not None

    def _receive_abort(self, src: int, meta: dict[str, Any]) -> None:
        abort = self._learn_failure(meta["error"], meta["origin"])
        abort.markers.add(src)

    def _wait_as_root(self, root: Task, reason: str, done: Callable[[], bool]) -> None:
        """The step's root waits until ``done()``; if the step fails here or elsewhere, it ends the step on every
        rank and raises the step's error."""
        try:
            while not done() and self._abort is None:
                self.scheduler.block(root, reason, expects_reply=False)
        except Exception as exc:  # noqa: BLE001 - every rank ends the step, then raises this
            self._end_failed_step(root, exc)
        if self._abort is not None:
            self._end_failed_step(root, self._abort.error)

    def _end_failed_step(self, root: Task, error: BaseException) -> NoReturn:
        """Called by the root task when its step failed: unwind everywhere, then raise the step's error."""
        if self._broken is not None or isinstance(error, SMPTimeoutError):
            self._break(f"an earlier step failed: {failure.summary(error)}")
            raise error
        abort = self._learn_failure(error, self.rank)
        self._unwind(root, abort)
        self._forget_step()
        if self.lockstep is not None:
            self._break(f"a step failed with tensor parallelism inside the pipeline: {failure.summary(abort.error)}")
        if abort.origin != self.rank:
            failure.raised_elsewhere(abort.error, abort.origin, self.rank)
        raise abort.error

    def _unwind(self, root: Task, abort: _Abort) -> None:
        """Let every task of the step unwind, tell the peers, and wait until each peer has said it is done."""
        peers = [r for r in self.pp_members if r != self.rank]
        priority, root.priority = root.priority, _UNWIND_PRIORITY
        try:
            while True:
                others = self._stop_tasks(root)
                if not others and not abort.told:
                    self._releases.clear()
                    meta = {"error": failure.portable(abort.error), "origin": abort.origin}
                    for peer in peers:
                        self._send(peer, ABORT, meta)
                    abort.told = True
                if not others and abort.markers.issuperset(peers):
                    return
                try:
                    if others:
                        self.scheduler.pause(root)
                    else:
                        self.scheduler.block(root, "the other pipeline ranks to end the failed step")
                except Exception as exc:  # noqa: BLE001 - a task's unwinding error: the step's first error is raised
                    if self._broken is not None or isinstance(exc, SMPTimeoutError):
                        self._break(f"a step failed and could not be ended on every rank: {failure.summary(exc)}")
                        raise
        finally:
            root.priority = priority

    def _stop_tasks(self, root: Task) -> list[Task]:
        """Drop tasks that never started; wake the others with ``StepAborted``. Returns the tasks left."""
        left = []
        for task in list(self.scheduler.tasks):
            if task is root or task.done:
                continue
            if not task.started:
                self.scheduler.tasks.remove(task)
                continue
            if not isinstance(task.wakeup, Fatal):
                self.scheduler.wake(task, Fatal(StepAborted(f"the step failed on rank {self._abort.origin}")))
            left.append(task)
        return left

    def _forget_step(self) -> None:
        """Nothing of the failed step is in flight any more: drop what it left behind."""
        for table in (self._waiting, self._requests, self._request_owner, self._mb_calls, self._hosted, self._releases):
            table.clear()
        self._end_step = None
        self._abort = None

