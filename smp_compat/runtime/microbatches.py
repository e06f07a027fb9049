"""The microbatch tasks of one step call on pp_rank 0: started within the in-flight limit, simple or interleaved."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from smp_compat.runtime.remote import Context, RemoteTensor, set_context
from smp_compat.runtime.structure import fill_tensors, flatten_tensors
from smp_compat.runtime.tasks import BACKWARD, FORWARD, Task
from smp_compat.stepping.step import StepCall

if TYPE_CHECKING:
    from smp_compat.runtime.engine import PipelineEngine

__all__ = ["StepRun", "materialized"]


class StepRun:
    """The microbatch tasks of one step call, started within the active limit."""

    def __init__(self, engine: PipelineEngine, step_fn: Any, call: StepCall, microbatches: list, root: Task) -> None:
        self.engine = engine
        self.step_fn = step_fn
        self.call = call
        self.microbatches = microbatches
        self.root = root
        self.outputs: list[Any] = [None] * len(microbatches)
        self.next_mb = 0
        self.running = 0
        self.finished = 0
        self.in_backward = 0
        self.simple = engine.cfg.pipeline == "simple"
        self.limit = engine.cfg.active_microbatches
        self.simple_waiters: list[Task] = []

    def start_more(self) -> None:
        while self.next_mb < len(self.microbatches) and self.running < self.limit:
            mb = self.next_mb
            self.next_mb += 1
            self.running += 1
            task = Task(f"microbatch-{mb}", None, (FORWARD, mb), mb)
            task.fn = self._body(task, mb)
            task.on_done = self._done
            self.engine.scheduler.spawn(task)

    def _body(self, task: Task, mb: int) -> Callable[[], Any]:
        def run() -> Any:
            set_context(Context(task, mb))
            try:
                args, kwargs = self.microbatches[mb]
                return materialized(self.step_fn.run_microbatch(mb, args, kwargs, self.call))
            finally:
                self.engine._end_microbatch(mb)
                set_context(None)

        return run

    def enter_backward(self, task: Task) -> None:
        """Backward work gets priority; with the simple pipeline it waits until every forward is done."""
        self.in_backward += 1
        if self.simple:
            self._release_simple_waiters()
            while self.in_backward + self.finished < len(self.microbatches):
                self.simple_waiters.append(task)
                self.engine.scheduler.block(task, "every microbatch's forward (simple pipeline)", expects_reply=False)
        task.priority = (BACKWARD, task.microbatch)
        task.phase = "backward"

    def _release_simple_waiters(self) -> None:
        if self.in_backward + self.finished >= len(self.microbatches):
            for waiter in self.simple_waiters:
                self.engine.scheduler.wake(waiter)
            self.simple_waiters.clear()

    def _done(self, task: Task) -> None:
        if task.error is not None:
            self.engine.scheduler.fail(task.error)
            return
        self.outputs[task.microbatch] = task.result
        self.running -= 1
        self.finished += 1
        if self.simple:
            self._release_simple_waiters()
        self.start_more()
        if self.finished == len(self.microbatches):
            self.engine.scheduler.wake(self.root)




def materialized(value: Any) -> Any:
    """Step outputs leave the microbatch: bring any result that stayed remote here."""
    skeleton, tensors = flatten_tensors(value)
    if not any(isinstance(t, RemoteTensor) for t in tensors):
        return value
    return fill_tensors(skeleton, [t.materialize() if isinstance(t, RemoteTensor) else t for t in tensors])
