"""The pipeline engine: partitions the model on the first step, then runs each step call.

pp_rank 0 runs the step body once per microbatch, as concurrent cooperative tasks; every rank
serves calls to the modules it owns. Calls, replies and gradients travel as messages; see
``remote.py`` for how autograd crosses ranks and ``tasks.py`` for how tasks take turns.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rich.console import Console
from torch import nn

from smp_compat import timeline
from smp_compat.errors import RemoteError, StepUsageError
from smp_compat.partitioning import PartitionPlan, auto_plan, manual_plan, trace_modules, validate_plan
from smp_compat.runtime.placement import Placement
from smp_compat.runtime.remote import (
    CallRecord,
    Context,
    RemoteOutputs,
    Scope,
    ServedCall,
    amp_state,
    context,
    set_context,
)
from smp_compat.runtime.structure import fill_tensors, flatten_tensors
from smp_compat.runtime.tasks import Fatal, Scheduler, Task
from smp_compat.runtime.transport import Message, Transport, create_channel_groups
from smp_compat.serialize import broadcast_object
from smp_compat.globalstate import state
from smp_compat.stepping import StepCall, in_step, is_tracing, set_current_microbatch, tracing_call

__all__ = ["PipelineEngine"]

log = logging.getLogger("smp_compat")

# Task priority classes, lowest first. A task resuming after a remote forward reply is on the
# critical path (it computes what another rank waits for: the next hop, or the loss whose gradient
# starts that rank's backward), then backward work (frees memory, 1F1B), then new forward work.
_CONTINUE, _BACKWARD, _FORWARD = 0, 1, 2


class PipelineEngine:
    """Everything pipeline-specific of one DistributedModel."""

    @classmethod
    def create(cls, model: Any, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> PipelineEngine:
        plan = _decide_plan(model, step_fn, microbatches)
        return cls(model, plan)

    def __init__(self, model: Any, plan: PartitionPlan) -> None:
        topo = state.topology
        self.model = model
        self.root: nn.Module = model.module
        self.plan = plan
        self.rank = state.rank
        self.pp_rank = topo.coords(self.rank).pp_rank
        self.pp_members = topo.get_pp_group(self.rank)
        self.cfg = state.cfg
        self.placement = Placement(self.root, plan)
        self.placement.release_non_local(self.pp_rank, state.device)
        self._install_dispatch()
        self.scheduler = Scheduler(self._handle, self.rank)
        groups = create_channel_groups(topo.all_groups("pp"))
        peers = [r for r in self.pp_members if r != self.rank]
        self.transport = Transport(self.rank, peers, groups, state.device, self.scheduler.inbox.put)
        self._seq = itertools.count()
        self._waiting: dict[tuple[int, int], Task] = {}
        self._records: dict[tuple[int, int], CallRecord] = {}
        self._served: dict[tuple[int, int], ServedCall] = {}
        self._step: _StepRun | None = None
        self._end_step: Message | None = None
        self._closed = False
        if self.rank == 0:
            log.info("Partition plan (%s):\n%s", plan.method, _render(plan, self.root))

    # ------------------------------------------------------------------ ownership
    def is_local_module(self, module: nn.Module) -> bool:
        return self.placement.rank_of_module(module) in (None, self.pp_rank)

    def local_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.placement.local_named_parameters(self.pp_rank)

    def local_named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return self.placement.local_named_buffers(self.pp_rank)

    # ------------------------------------------------------------------ dispatch
    def _install_dispatch(self) -> None:
        """Route each placed module's forward through the engine; group runs of nn.Sequential children."""
        for index, module in enumerate(self.placement.modules):
            owner = self.placement.rank_of_module(module)
            if owner is not None:
                module.forward = types.MethodType(_dispatching_forward(self, index, owner, module.forward), module)
            elif isinstance(module, nn.Sequential) and self.placement.spans_ranks(module):
                module.forward = types.MethodType(_sequential_forward(self, index), module)

    def run_target(self, target: tuple[Any, ...], args: tuple, kwargs: dict) -> Any:
        """Execute a call target on this rank: a module's own forward, or a run of Sequential children."""
        kind, index = target[0], target[1]
        module = self.placement.modules[index]
        if kind == "module":
            return module._smp_local_forward(*args, **kwargs)
        start, stop = target[2], target[3]
        (x,) = args
        for child in list(module)[start:stop]:
            x = child(x)
        return x

    def remote_call(self, owner_pp: int, target: tuple[Any, ...], args: tuple, kwargs: dict) -> Any:
        """Run ``target`` on pipeline rank ``owner_pp`` and return its outputs, attached to autograd."""
        ctx = _require_context(self, target)
        owner = self.pp_members[owner_pp]
        skeleton, tensors = flatten_tensors((args, kwargs))
        grad = torch.is_grad_enabled()
        needs_grad = [grad and t.requires_grad for t in tensors]
        call_id = (self.rank, next(self._seq))
        description = f"{self._describe(target)} on rank {owner} (microbatch {ctx.scope.microbatch})"
        meta = {
            "call": call_id, "target": target, "mb": ctx.scope.microbatch, "grad": grad,
            "amp": amp_state(), "skeleton": skeleton, "requires_grad": needs_grad,
        }  # fmt: skip
        self.transport.send(owner, "fwd", meta, tensors)
        self._waiting[call_id] = ctx.task
        phase = ctx.task.priority[0]
        ctx.task.priority = (_CONTINUE, ctx.scope.microbatch)
        reply: Message = self.scheduler.block(ctx.task, f"forward of {description}")
        ctx.task.priority = (phase, ctx.scope.microbatch)
        if reply.kind == "fwd_err":
            raise RemoteError(f"{description} failed on rank {owner}:\n{reply.meta['error']}")
        outputs = reply.tensors
        differentiable = reply.meta["differentiable"]
        if any(differentiable):
            record = CallRecord(
                call_id, owner, ctx.scope, [t if n else None for t, n in zip(tensors, needs_grad)],
                differentiable, description, received=list(outputs),
            )  # fmt: skip
            ctx.scope.calls[call_id] = record
            self._records[call_id] = record
            outputs = list(RemoteOutputs.apply(self, record, _anchor()))
        return fill_tensors(reply.meta["skeleton"], outputs)

    def _describe(self, target: tuple[Any, ...]) -> str:
        name = self.placement.names[target[1]] or "<root>"
        return name if target[0] == "module" else f"{name}[{target[2]}:{target[3]}]"

    # ------------------------------------------------------------------ backward
    def send_output_grads(self, record: CallRecord, grads: list[torch.Tensor | None]) -> None:
        """Called from autograd: ship the gradients of a remote call's outputs to its owner."""
        record.triggered = True
        record.scope.outstanding.add(record.call_id)
        has = [g is not None for g in grads]
        self.transport.send(record.owner, "bwd", {"call": record.call_id, "has": has}, [g for g in grads if g is not None])

    def backward(self, tensors: list[torch.Tensor], grad_tensors: list[torch.Tensor]) -> None:
        """``model.backward`` inside a microbatch task on pp_rank 0."""
        ctx = context()
        if ctx is None or self._step is None:
            raise StepUsageError("model.backward() must run inside the @smp.step function body.")
        self._step.enter_backward(ctx.task)
        self._drive_backward(ctx, tensors, grad_tensors)

    def _drive_backward(self, ctx: Context, tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """Local segment, then one more segment per batch of input gradients returned by owners."""
        scope = ctx.scope
        _segment(tensors, grads)
        while scope.outstanding:
            ready = [c for c in scope.outstanding if c in scope.responses]
            if not ready:
                scope.waiting_task = ctx.task
                pending = ", ".join(scope.calls[c].description for c in sorted(scope.outstanding))
                self.scheduler.block(ctx.task, f"input gradients of {pending}")
                scope.waiting_task = None
                continue
            roots, root_grads = [], []
            for call_id in sorted(ready):
                scope.outstanding.discard(call_id)
                record = scope.calls.pop(call_id)
                self._records.pop(call_id, None)
                for t, g in zip(record.grad_inputs, scope.responses.pop(call_id)):
                    if t is not None and g is not None:
                        roots.append(t)
                        root_grads.append(g)
            _segment(roots, root_grads)
        self._release_untriggered(scope)

    def _release_untriggered(self, scope: Scope) -> None:
        """Calls whose outputs got no gradient: tell their owners to drop the saved graphs."""
        by_owner: dict[int, list[tuple[int, int]]] = {}
        for call_id, record in scope.calls.items():
            if not record.triggered:
                by_owner.setdefault(record.owner, []).append(call_id)
                self._records.pop(call_id, None)
        scope.calls.clear()
        for owner, calls in by_owner.items():
            self.transport.send(owner, "release", {"calls": calls})

    # ------------------------------------------------------------------ messages
    def _handle(self, message: Message) -> None:
        """Runs in whichever thread holds the baton: turn a message into wake-ups or new tasks."""
        kind, meta = message.kind, message.meta
        if kind in ("fwd_ok", "fwd_err"):
            self.scheduler.wake(self._waiting.pop(meta["call"]), message)
        elif kind == "fwd":
            self._spawn_served(message, _FORWARD, self._serve_forward)
        elif kind == "bwd":
            self._spawn_served(message, _BACKWARD, self._serve_backward)
        elif kind in ("bwd_ok", "bwd_err"):
            self._on_input_grads(message)
        elif kind == "release":
            for call_id in meta["calls"]:
                self._release_served(call_id)
        elif kind == "end_step":
            self._end_step = message
            if self.scheduler.root is not None:
                self.scheduler.wake(self.scheduler.root, message)
        elif kind == "transport_error":
            raise RemoteError(f"pipeline transport on rank {self.rank} failed: {meta['error']}")

    def _spawn_served(self, message: Message, phase: int, serve: Callable[[Task, Message], None]) -> None:
        mb = message.meta["mb"] if phase == _FORWARD else self._served_mb(message)
        task = Task(f"serve-{'fwd' if phase == _FORWARD else 'bwd'}-mb{mb}", None, (phase, mb))
        task.phase = "forward" if phase == _FORWARD else "backward"
        task.fn = lambda: serve(task, message)
        self.scheduler.spawn(task)

    def _served_mb(self, message: Message) -> int:
        served = self._served.get(message.meta["call"])
        return served.scope.microbatch if served else 0

    def _serve_forward(self, task: Task, message: Message) -> None:
        meta = message.meta
        description = f"{self._describe(meta['target'])} (microbatch {meta['mb']}, forward)"
        scope = Scope(meta["mb"])
        set_context(Context(task, scope))
        set_current_microbatch(meta["mb"])
        try:
            inputs = [t.requires_grad_() if n else t for t, n in zip(message.tensors, meta["requires_grad"])]
            args, kwargs = fill_tensors(meta["skeleton"], inputs)
            with torch.set_grad_enabled(meta["grad"]), _autocast(meta["amp"]):
                result = self.run_target(meta["target"], args, kwargs)
            skeleton, outputs = flatten_tensors(result)
            differentiable = [meta["grad"] and o.requires_grad for o in outputs]
        except BaseException:  # noqa: BLE001 - the caller raises it with this rank's traceback
            self._reply_error(message, "fwd_err", description)
            return
        if any(differentiable):
            grad_inputs = [t for t, n in zip(inputs, meta["requires_grad"]) if n]
            grad_outputs = [o for o, d in zip(outputs, differentiable) if d]
            self._served[meta["call"]] = ServedCall(meta["call"], message.src, grad_inputs, grad_outputs, scope, description)
        else:
            self._release_untriggered(scope)
        reply = {"call": meta["call"], "skeleton": skeleton, "differentiable": differentiable}
        self.transport.send(message.src, "fwd_ok", reply, outputs)

    def _serve_backward(self, task: Task, message: Message) -> None:
        meta = message.meta
        served = self._served.pop(meta["call"])
        set_context(Context(task, served.scope))
        set_current_microbatch(served.scope.microbatch)
        grads = iter(message.tensors)
        pairs = [(o, next(grads)) for o, has in zip(served.outputs, meta["has"]) if has]
        try:
            self._drive_backward(Context(task, served.scope), [o for o, _ in pairs], [g for _, g in pairs])
        except BaseException:  # noqa: BLE001 - the caller raises it with this rank's traceback
            self._reply_error(message, "bwd_err", served.description.replace("forward", "backward"))
            return
        input_grads = [t.grad for t in served.inputs]
        reply = {"call": meta["call"], "has": [g is not None for g in input_grads]}
        self.transport.send(message.src, "bwd_ok", reply, [g for g in input_grads if g is not None])

    def _on_input_grads(self, message: Message) -> None:
        call_id = message.meta["call"]
        record = self._records[call_id]
        scope = record.scope
        if message.kind == "bwd_err":
            error = RemoteError(f"backward of {record.description} failed:\n{message.meta['error']}")
            if scope.waiting_task is None:
                self.scheduler.fail(error)
            else:
                self.scheduler.wake(scope.waiting_task, Fatal(error))
            return
        tensors = iter(message.tensors)
        scope.responses[call_id] = [next(tensors) if has else None for has in message.meta["has"]]
        if scope.waiting_task is not None:
            self.scheduler.wake(scope.waiting_task)

    def _release_served(self, call_id: tuple[int, int]) -> None:
        served = self._served.pop(call_id, None)
        if served is not None:
            self._release_untriggered(served.scope)

    def _reply_error(self, message: Message, kind: str, description: str) -> None:
        text = f"rank {self.rank}, {description}:\n{traceback.format_exc()}"
        log.error("smp_compat: %s", text)
        self.transport.send(message.src, kind, {"call": message.meta["call"], "error": text})

    # ------------------------------------------------------------------ steps
    def run_step(self, step_fn: Any, call: StepCall, microbatches: list[tuple[tuple, dict]]) -> list[Any]:
        """One ``@smp.step`` call: pp_rank 0 drives the microbatches, the other ranks serve until told to stop."""
        root = self.scheduler.adopt("step")
        started = timeline.now()
        try:
            if self.pp_rank == 0:
                outputs = self._drive_step(root, step_fn, call, microbatches)
            else:
                outputs = self._serve_step(root)
        finally:
            self.scheduler.release_root()
            self._step = None
        recorder = timeline.current()
        if recorder is not None:
            recorder.add_step(started, timeline.now())
        return outputs

    def _drive_step(self, root: Task, step_fn: Any, call: StepCall, microbatches: list[tuple[tuple, dict]]) -> list[Any]:
        run = _StepRun(self, step_fn, call, microbatches, root)
        self._step = run
        run.start_more()
        self.scheduler.block(root, "microbatches of this step to finish", expects_reply=False)
        skeleton, tensors = flatten_tensors([_detach(o) for o in run.outputs])
        for peer in self.pp_members:
            if peer != self.rank:
                self.transport.send(peer, "end_step", {"skeleton": skeleton, "backward": self.model._backward_ran}, tensors)
        return run.outputs

    def _serve_step(self, root: Task) -> list[Any]:
        while self._end_step is None:
            self.scheduler.block(root, "rank 0 to finish the step", expects_reply=False)
        message, self._end_step = self._end_step, None
        self.model._backward_ran = message.meta["backward"]  # only pp_rank 0 sees model.backward calls
        return fill_tensors(message.meta["skeleton"], message.tensors)

    def close(self) -> None:
        """Stop the transport threads (every pipeline rank, at shutdown)."""
        if not self._closed:
            self._closed = True
            self.transport.close()

    @property
    def bytes_sent(self) -> int:
        return self.transport.payload_bytes


class _StepRun:
    """The microbatch tasks of one step call on pp_rank 0, started within the active limit."""

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
            task = Task(f"microbatch-{mb}", None, (_FORWARD, mb))
            task.fn = self._body(task, mb)
            task.on_done = self._done
            self.engine.scheduler.spawn(task)

    def _body(self, task: Task, mb: int) -> Callable[[], Any]:
        def run() -> Any:
            scope = Scope(mb)
            set_context(Context(task, scope))
            try:
                args, kwargs = self.microbatches[mb]
                return self.step_fn.run_microbatch(mb, args, kwargs, self.call)
            finally:
                self.engine._release_untriggered(scope)
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
        task.priority = (_BACKWARD, task.priority[1])
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
        self.outputs[task.priority[1]] = task.result
        self.running -= 1
        self.finished += 1
        if self.simple:
            self._release_simple_waiters()
        self.start_more()
        if self.finished == len(self.microbatches):
            self.engine.scheduler.wake(self.root)


# ---------------------------------------------------------------------- helpers
def _segment(tensors: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """One local backward; the graph is kept because a later segment may pass through the same nodes."""
    pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], retain_graph=True)


_ANCHOR: list[torch.Tensor] = []


def _anchor() -> torch.Tensor:
    """A leaf that requires grad, so RemoteOutputs is recorded by autograd even if no input needs grad."""
    if not _ANCHOR:
        _ANCHOR.append(torch.zeros((), requires_grad=True))
    return _ANCHOR[0]


def _detach(value: Any) -> Any:
    skeleton, tensors = flatten_tensors(value)
    return fill_tensors(skeleton, [t.detach() for t in tensors])


@contextlib.contextmanager
def _autocast(amp: dict[str, tuple[bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type, (enabled, dtype) in amp.items():
            if enabled:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


def _require_context(engine: PipelineEngine, target: tuple[Any, ...]) -> Context:
    ctx = context()
    if ctx is None:
        raise StepUsageError(
            f"{engine._describe(target)} lives on another pipeline rank and was called outside the step "
            "function's microbatch. Call the model only inside an @smp.step function."
        )
    return ctx


def _dispatching_forward(engine: PipelineEngine, index: int, owner: int, local: Callable[..., Any]) -> Callable[..., Any]:
    """A forward that runs locally on the owner (and while tracing), else as a remote call."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if owner == engine.pp_rank or is_tracing():
            return local(*args, **kwargs)
        if not in_step():
            raise StepUsageError(
                f"module {engine.placement.names[index]!r} lives on pipeline rank {owner}; with "
                "pipeline_parallel_degree > 1 it can only be called inside an @smp.step function."
            )
        return engine.remote_call(owner, ("module", index), args, kwargs)

    engine.placement.modules[index]._smp_local_forward = local
    return forward


def _sequential_forward(engine: PipelineEngine, index: int) -> Callable[..., Any]:
    """nn.Sequential forward that sends each run of children living on one other rank as one request."""
    runs = engine.placement.sequential_runs(engine.placement.modules[index])

    def forward(self: nn.Module, x: Any) -> Any:
        children = list(self)
        for start, stop, rank in runs:
            if rank is None or rank == engine.pp_rank or not in_step() or is_tracing():
                for child in children[start:stop]:
                    x = child(x)
            else:
                x = engine.remote_call(rank, ("seq", index, start, stop), (x,), {})
        return x

    return forward


def _decide_plan(model: Any, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> PartitionPlan:
    """Global rank 0 traces (auto) or reads the manual assignment, then every rank gets the same plan."""
    cfg = state.cfg
    plan_dict = None
    if state.rank == 0:
        root = model.module
        if cfg.auto_partition:
            if not microbatches:
                raise StepUsageError("automatic partitioning needs the step inputs on rank 0")
            args, kwargs = microbatches[0]
            with tracing_call(len(microbatches)) as call:
                trace = trace_modules(
                    root, lambda: step_fn.run_microbatch(0, args, kwargs, call), measure_time=model.trace_execution_times
                )
            plan = auto_plan(root, trace, cfg.pipeline_parallel_degree, cfg.memory_weight)
        else:
            plan = manual_plan(root, cfg.pipeline_parallel_degree, cfg.default_partition)
        validate_plan(root, plan)
        plan_dict = plan.to_dict()
    plan_dict = broadcast_object(plan_dict, src=0)
    return PartitionPlan.from_dict(plan_dict)


def _render(plan: PartitionPlan, root: nn.Module) -> str:
    console = Console(width=120, file=io.StringIO())
    console.print(plan.render(root))
    return console.file.getvalue()
