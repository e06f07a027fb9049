"""Cooperative tasks: one thread per task, exactly one of them running at a time.

Tasks run on a pool of long-lived worker threads. A task runs until it must wait for another rank;
then it picks the next task by priority and hands over the baton itself (no scheduler thread in
between), or, if nothing can run, serves incoming messages until something can. A thread whose task
ended runs the next new task itself, so a rank that only serves computes on one thread. Free-running
threads sharing a lock measured about 0.7x of torch's Schedule1F1B here; explicit hand-over is what
makes the eager design fast, and every hand-over avoided counts: a woken thread may land on a core
that another rank keeps busy.
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from smp_compat import timeline
from smp_compat.errors import SMPTimeoutError
from smp_compat.runtime.mailbox import Mailbox
from smp_compat.runtime.thread_state import CallerState, cuda_device_setter

__all__ = ["Task", "Scheduler", "Fatal", "CONTINUE", "SERVE_FORWARD", "FORWARD", "SERVE_BACKWARD", "BACKWARD", "WEIGHTS"]

# Priority classes, lowest first. Rank 0 must compute each loss (and send its gradient) as soon as the
# forward reply is in, and the last rank must never run dry: so a task resuming after a remote forward
# reply comes first, then served forward requests, then a new microbatch's forward, and backward work
# last (served requests in arrival order). The in-flight limit (active_microbatches) bounds memory
# whatever the order; with backward first, rank 0's long backward segments delayed the forwards that feed
# the next rank (measured and simulated in docs/benchmarks.md). Weight gradients left for after a reply
# (late_weights.py) come when nothing else can run: no other rank waits for them.
CONTINUE, SERVE_FORWARD, FORWARD, SERVE_BACKWARD, BACKWARD, WEIGHTS = 0, 1, 2, 3, 4, 5

log = logging.getLogger("smp_compat")

_TIMEOUT_ENV = "SMP_PIPELINE_TIMEOUT_S"
_DEFAULT_TIMEOUT_S = 300.0
_IDLE_NOTICE_S = 300.0
_POLL_S = 0.5


class Fatal:
    """A wake-up value that makes the woken task raise ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Task:
    """A unit of work: a microbatch of the step body, or one served forward/backward request."""

    _ids = itertools.count()

    def __init__(
        self, name: str, fn: Callable[[], Any] | None, priority: tuple[int, ...], microbatch: int | None = None
    ) -> None:
        self.id = next(Task._ids)
        self.name = name
        self.microbatch = microbatch
        self.fn = fn
        self.priority = priority
        self.go = threading.Lock()  # held while the task waits for the baton; released to hand it over
        self.go.acquire()
        self.runnable = False
        self.started = False
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.wakeup: Any = None
        self.waiting_for = ""
        self.expects_reply = False
        self.on_done: Callable[[Task], None] | None = None
        self.resumed_at = 0.0
        self.phase = "forward"  # "forward" or "backward", for the timeline
        # lockstep (runtime/lockstep.py): the same task's name in every tp pipeline, a payload the leader
        # computes when it picks the task (``share``), whether a follower's task can take it (``accepts``)
        self.key: tuple = (name,)
        self.share: Callable[[], Any] | None = None
        self.accepts: Callable[[Any], bool] | None = None
        self.shared: Any = None

    def __repr__(self) -> str:
        return f"Task({self.name}, waiting for {self.waiting_for or 'nothing'})"


class Scheduler:
    """Runs tasks one at a time; ``handle`` turns each incoming message into wake-ups or new tasks."""

    def __init__(self, handle: Callable[[Any], None], rank: int, device: torch.device) -> None:
        self.inbox = Mailbox()
        self.handle = handle
        self.rank = rank
        self.tasks: list[Task] = []
        self.root: Task | None = None
        self.timeout = float(os.environ.get(_TIMEOUT_ENV, _DEFAULT_TIMEOUT_S))
        self._torch_threads = torch.get_num_threads()
        self._set_device = cuda_device_setter(device)
        self._caller_state = CallerState.capture()
        # most recently idle first (a stack): work stays on few, warm threads (their malloc arenas and
        # caches), where a queue rotated it over every worker; append/pop are atomic in CPython
        self._idle_workers: collections.deque[queue.SimpleQueue] = collections.deque()
        self._workers: list[queue.SimpleQueue] = []
        self._context = contextvars.copy_context()
        self.lockstep: Any = None  # a Lockstep when tp peers of a pipeline stage must run tasks in one order
        self.rng: Any = None  # a MicrobatchRng when each microbatch draws from its own random stream

    def adopt(self, name: str) -> Task:
        """Make the calling thread (the one in the step call) the root task; it holds the baton."""
        self.root = Task(name, None, (-1,))
        self.root.started = True  # it runs in its own thread already
        self._context = contextvars.copy_context()  # torch's configs (dynamo, inductor...) are context variables
        self._caller_state = CallerState.capture()  # and autocast, modes, hooks are thread-local: tasks share them
        self.tasks.append(self.root)
        return self.root

    def release_root(self) -> None:
        if self.root is not None:
            self.tasks.remove(self.root)
            self.root = None

    # ------------------------------------------------------------------ used by the baton holder
    def spawn(self, task: Task) -> None:
        """Add a new runnable task; it gets a thread when it is first picked."""
        task.runnable = True
        self.tasks.append(task)

    def _start_on_worker(self, task: Task) -> None:
        try:
            worker = self._idle_workers.pop()
        except IndexError:
            worker = self._new_worker()
        worker.put(task)

    def _new_worker(self) -> queue.SimpleQueue:
        """A long-lived worker thread. Fresh threads per task cost twice: torch's per-thread state was not set
        up (BLAS ran with the default thread count, ~6x slower matmuls here) and each new thread's memory
        arena page-faulted its tensors in again (~25k faults per step)."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(target=self._worker_loop, args=(inbox,), name="smp-worker", daemon=True)
        thread.start()
        self._workers.append(inbox)
        return inbox

    def _worker_loop(self, inbox: queue.SimpleQueue) -> None:
        torch.set_num_threads(self._torch_threads)
        self._set_device()
        while True:
            task = inbox.get()
            if task is None:
                return
            while task is not None:
                task = self._run_task(task)
            self._idle_workers.append(inbox)

    def close(self) -> None:
        """End the idle worker threads (at engine shutdown)."""
        for inbox in self._workers:
            inbox.put(None)
        self.inbox.close()

    def wake(self, task: Task, value: Any = None) -> None:
        """Make a waiting task runnable; it resumes with ``value`` returned from its ``block``."""
        task.wakeup = value
        task.waiting_for = ""
        task.expects_reply = False
        task.runnable = True

    def block(self, me: Task, reason: str, expects_reply: bool = True) -> Any:
        """Give up the baton until someone ``wake``s ``me``; returns the wake-up value."""
        me.waiting_for = reason
        me.expects_reply = expects_reply
        me.runnable = False
        return self._pass_baton(me)

    def pause(self, me: Task) -> Any:
        """Stay runnable but let every task that ranks before ``me`` run first."""
        me.runnable = True
        me.waiting_for = ""
        return self._pass_baton(me)

    # ------------------------------------------------------------------ internals
    def _run_task(self, task: Task) -> Task | None:
        """Run a task that was just picked; returns a new task this (now free) thread runs next, if any."""
        task.resumed_at = timeline.now()
        try:
            with self._caller_state.applied():
                task.result = self._context.copy().run(task.fn)  # the step caller's context, one copy per task
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for this task
            task.error = exc
        task.done = True
        self.tasks.remove(task)
        try:
            if task.on_done is not None:
                task.on_done(task)
        except BaseException as exc:  # noqa: BLE001 - the root task raises it
            self.fail(exc)
        nxt = self._pass_baton(task)
        task.fn = None  # its closure refers to the task: without this, only the cyclic GC would free the
        return nxt  # task and the message tensors it holds

    def fail(self, exc: BaseException) -> None:
        """Wake the root task with ``exc``, which it raises in the thread that called the step; the first
        failure wins (a peer that left is reported, not the failed send to it that came next)."""
        if self.root is None:
            raise exc
        if not isinstance(self.root.wakeup, Fatal):
            self.wake(self.root, Fatal(exc))

    def _pick(self) -> Task | None:
        best = None
        for task in self.tasks:
            if task.runnable and (best is None or task.priority < best.priority):
                best = task
        return best

    def _pass_baton(self, me: Task) -> Any:
        self._record_run(me)
        idle_since = time.monotonic()
        while True:
            try:
                self._drain()
                nxt = self._pick() if self.lockstep is None else self.lockstep.choose(self)
                if nxt is None:
                    self._wait_for_message(idle_since)
                    continue
            except BaseException as exc:  # noqa: BLE001 - raised by the root, wherever it happened
                if me is self.root:
                    raise
                self.fail(exc)
                continue
            nxt.runnable = False
            if self.rng is not None:
                self.rng.switch(nxt.microbatch)
            if nxt is me:
                return self._resume(me)
            if nxt.started:
                nxt.go.release()
            else:
                nxt.started = True
                if me.done:
                    return nxt  # this thread is free: it runs the new task itself (no hand-over)
                self._start_on_worker(nxt)
            if me.done:
                return None
            me.go.acquire()
            return self._resume(me)

    @staticmethod
    def _resume(me: Task) -> Any:
        me.resumed_at = timeline.now()
        value, me.wakeup = me.wakeup, None
        if isinstance(value, Fatal):
            raise value.error
        return value

    def _drain(self) -> None:
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.handle(message)

    def _wait_for_message(self, idle_since: float) -> None:
        start = timeline.now()
        try:
            message = self.inbox.get(timeout=_POLL_S)
        except queue.Empty:
            message = None
        self._record_idle(start)
        if message is None:
            self._check_idle(idle_since)
        else:
            self.handle(message)

    @staticmethod
    def _record_idle(start: float) -> None:
        recorder = timeline.current()
        if recorder is not None:
            recorder.add(timeline.Span("compute", "idle", "idle", start, timeline.now()))

    @staticmethod
    def _record_run(task: Task) -> None:
        recorder = timeline.current()
        if recorder is not None and task.fn is not None and task.resumed_at:
            span = timeline.Span("compute", task.name, task.phase, task.resumed_at, timeline.now(), task.microbatch)
            recorder.add(span)

    def _check_idle(self, idle_since: float) -> None:
        idle = time.monotonic() - idle_since
        waiting = [t for t in self.tasks if t.expects_reply]
        if waiting and idle > self.timeout:
            lines = "\n".join(f"  - {t.name}: waiting for {t.waiting_for}" for t in waiting)
            if self.lockstep is not None:
                lines += self.lockstep.describe()
            raise SMPTimeoutError(
                f"rank {self.rank} waited {idle:.0f} s with no message from the other pipeline ranks:\n{lines}\n"
                f"Another rank may be stuck or dead. Raise {_TIMEOUT_ENV} if a step legitimately takes longer."
            )
        if not waiting and idle > _IDLE_NOTICE_S and int(idle) % int(_IDLE_NOTICE_S) < _POLL_S:
            log.warning("rank %d idle for %.0f s waiting for pipeline work", self.rank, idle)
