"""The pipeline engine: partitions the model on the first step, then runs each step call.

pp_rank 0 runs the step body once per microbatch, as concurrent cooperative tasks; every rank
serves calls to the modules it owns. Calls, replies and gradients travel as messages; see
``remote.py`` for how autograd crosses ranks, ``tasks.py`` for how tasks take turns, ``serving.py`` for
the owner side of a call and ``dispatch.py`` for how a module call finds its owner.
"""

from __future__ import annotations

import collections
import itertools
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from smp_compat import timeline
from smp_compat.memory.activation_checkpointing import requested_checkpointing
from smp_compat.errors import RemoteError, SMPUnsupportedError, StepUsageError
from smp_compat.memory.materialize import materialize_local
from smp_compat.partitioning import PartitionPlan
from smp_compat.runtime import hf_state
from smp_compat.runtime.dispatch import call_children, call_local, dispatching_forward, sequential_forward
from smp_compat.runtime.ordered_grads import OrderedGradients
from smp_compat.runtime.placement import Placement
from smp_compat.runtime.remote import (
    CallRecord,
    Context,
    Driver,
    Hosted,
    MicrobatchCalls,
    RemoteOutputs,
    RemoteTensor,
    ValueId,
    anchor,
    context,
)
from smp_compat.runtime.rng_streams import MicrobatchRng
from smp_compat.runtime.structure import fill_tensors, flatten_tensors
from smp_compat.runtime.backward import BackwardSide
from smp_compat.runtime.failed_step import ABORT, FailedStepSide
from smp_compat.runtime import late_weights
from smp_compat.runtime.lockstep import DECISION, create_lockstep
from smp_compat.runtime.microbatches import StepRun
from smp_compat.runtime.planning import decide_plan, render_plan
from smp_compat.runtime.serving import ServingSide
from smp_compat.runtime.thread_state import amp_state
from smp_compat.runtime.tasks import CONTINUE, SERVE_BACKWARD, SERVE_FORWARD, Scheduler, Task
from smp_compat.runtime.messages import Message
from smp_compat.runtime.transport import Transport, create_channel_groups
from smp_compat.globalstate import state
from smp_compat.stepping.step import StepCall

__all__ = ["PipelineEngine"]

log = logging.getLogger("smp_compat")


class PipelineEngine(BackwardSide, ServingSide, FailedStepSide):
    """Everything pipeline-specific of one DistributedModel (the owner side of calls is in serving.py, the
    caller's backward in backward.py, ending a failed step in failed_step.py)."""

    @classmethod
    def create(cls, model: Any, step_fn: Any, microbatches: list[tuple[tuple, dict]]) -> PipelineEngine:
        plan = decide_plan(model, step_fn, microbatches)
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
        local = [m for n, m in zip(self.placement.names, self.placement.modules) if plan.rank_of(n) == self.pp_rank]
        materialize_local(self.root, local, state.device)
        self.placement.release_non_local(self.pp_rank, state.device)
        self._install_dispatch()
        self.scheduler = Scheduler(self._handle, self.rank, state.device)
        groups = create_channel_groups(topo.all_groups("pp"))
        peers = [r for r in self.pp_members if r != self.rank]
        self.transport = Transport(self.rank, peers, groups, state.device, self.scheduler.inbox)
        self.lockstep = create_lockstep(self.rank, self.scheduler)  # None unless tp > 1
        self.device = state.device
        self._seq = itertools.count()
        self._arrivals = itertools.count()
        self._served_from: collections.defaultdict[int, Iterator[int]] = collections.defaultdict(itertools.count)
        self._waiting: dict[tuple[int, int], Task] = {}
        self._requests: dict[tuple[int, int], Driver] = {}
        self._request_owner: dict[tuple[int, int], int] = {}
        self._mb_calls: dict[int, MicrobatchCalls] = {}
        self._hosted: dict[tuple[int, int], Hosted] = {}
        self._lazy_sites: set[tuple[Any, ...]] = set()
        self._compiler = getattr(model, "compiler", None)
        if self._compiler is not None:
            self._compiler.check_pipeline()
        # a compiled model: served calls compiled too; the module is an input, so one class compiles once
        self._call_local = self._compiler(call_local) if self._compiler is not None else call_local
        self._call_children = self._compiler(call_children) if self._compiler is not None else call_children
        self._driving: Driver | None = None
        self._releases: dict[int, list[tuple[int, int]]] = {}  # owner -> (step, microbatch) it may forget
        self._step_number = 0
        self._ordered = (
            OrderedGradients([p for _, p in self.local_named_parameters() if p.requires_grad], self._driving_microbatch)
            if state.cfg.deterministic_server
            else None
        )
        self._rng = MicrobatchRng(state.device) if state.cfg.deterministic_server else None
        self.scheduler.rng = self._rng
        self._late_weights_on = self._late_weights_allowed()
        self._left_weights: tuple | None = None
        self._widest: dict[tuple[Any, ...], int] = {}
        self._step: StepRun | None = None
        self._end_step: Message | None = None
        self._abort = None
        self._deferred: list[Message] = []
        self._broken: str | None = None
        self._closed = False
        if self.rank == 0:
            log.info("Partition plan (%s):\n%s", plan.method, render_plan(plan, self.root))

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
                module.forward = types.MethodType(dispatching_forward(self, index, owner, module.forward), module)
            elif isinstance(module, nn.Sequential) and self.placement.spans_ranks(module):
                module.forward = types.MethodType(sequential_forward(self, index), module)

    def run_target(self, target: tuple[Any, ...], args: tuple, kwargs: dict) -> Any:
        """Execute a call target on this rank: a module's own forward, or a run of Sequential children."""
        kind, index = target[0], target[1]
        module = self.placement.modules[index]
        if kind == "module":
            return self._call_local(module, *args, **kwargs)
        (x,) = args
        return self._call_children(module, target[2], target[3], x)

    def _late_weights_allowed(self) -> bool:
        """Whether served backwards reply before their weight gradients (late_weights.py): not under tp
        lockstep, ``deterministic_server``, sharding or ``torch.compile``, whose hooks and graphs expect the
        gradients inside the backward; on CPU only, until its fixed cost is measured against a GPU's kernels."""
        plain = self.lockstep is None and self._ordered is None and self._compiler is None
        single = state.cfg.sharded_data_parallel_degree == 1 and state.device.type == "cpu"
        return plain and single and late_weights.enabled(len(self.pp_members))

    def _describe(self, target: tuple[Any, ...]) -> str:
        name = self.placement.names[target[1]] or "<root>"
        return name if target[0] == "module" else f"{name}[{target[2]}:{target[3]}]"

    def _calls(self, mb: int) -> MicrobatchCalls:
        calls = self._mb_calls.get(mb)
        if calls is None or calls.step != self._step_number:
            calls = self._mb_calls[mb] = MicrobatchCalls(mb, self._step_number)
        return calls

    # ------------------------------------------------------------------ caller side
    def remote_call(self, owner_pp: int, target: tuple[Any, ...], args: tuple, kwargs: dict) -> Any:
        """Run ``target`` on pipeline rank ``owner_pp``; outputs come back attached to autograd (or stay there)."""
        ctx = _require_context(self, target)
        if torch._C._current_graph_task_id() != -1:
            _refuse_recomputation(self, target)
        owner = self.pp_members[owner_pp]
        calls = self._calls(ctx.microbatch)
        skeleton, tensors = flatten_tensors((args, kwargs))
        grad = torch.is_grad_enabled()
        call_id = (self.rank, next(self._seq))
        site = (target, calls.site_counts.get(target, 0))
        calls.site_counts[target] = site[1] + 1
        record = CallRecord(call_id, owner, ctx.microbatch, site, f"{self._describe(target)} on rank {owner} "
                            f"(microbatch {ctx.microbatch})", grad_inputs=[])  # fmt: skip
        specs, data = self._encode_inputs(calls, record, tensors, grad)
        lazy = site in self._lazy_sites and self._compiler is None  # compiled code takes no RemoteTensor
        capture = hf_state.request(self.root)
        meta = {
            "call": call_id, "target": target, "mb": ctx.microbatch, "grad": grad, "amp": amp_state(),
            "skeleton": skeleton, "inputs": specs, "lazy": lazy, "checkpoint": requested_checkpointing(),
        }  # fmt: skip
        if capture:
            meta["capture"] = capture
        self._send(owner, "fwd", meta, data)
        reply = self._await(ctx, call_id, f"forward of {record.description}")
        if reply.kind == "fwd_err":
            raise RemoteError(f"{record.description} failed:\n{reply.meta['error']}", reply.meta.get("root"))
        calls.records[call_id] = record
        outputs = self._decode_outputs(calls, record, reply, grad)
        result = fill_tensors(reply.meta["skeleton"], outputs)
        if capture:
            result, captured = result
            hf_state.merge(captured)
        return result

    def _encode_inputs(self, calls: MicrobatchCalls, record: CallRecord, tensors: list[torch.Tensor],
                       grad: bool) -> tuple[list[tuple], list[torch.Tensor]]:  # fmt: skip
        """Each input as a reference to a value the owner already holds, or as data (a new received input there).

        ``record.grad_inputs[i]`` is the caller's tensor behind the owner's received input ``(call, "in", i)``.
        """
        specs, data = [], []
        for t in tensors:
            held = self._held_by_owner(calls, record.owner, t, grad)
            if held is not None:
                specs.append(("ref", held))
                record.grad_inputs.append(None)
                continue
            if isinstance(t, RemoteTensor):
                t = t.materialize()
            needs_grad = grad and t.requires_grad
            calls.remember(record.owner, t, (record.call_id, "in", len(specs)), needs_grad)
            specs.append(("data", len(data), needs_grad))
            record.grad_inputs.append(t if needs_grad else None)
            data.append(t)
        return specs, data

    def _held_by_owner(self, calls: MicrobatchCalls, owner: int, t: torch.Tensor, grad: bool) -> ValueId | None:
        """The owner's value for ``t`` when it has it already (a result it produced, or data sent before)."""
        if isinstance(t, RemoteTensor):
            if t._owner != owner or t.changed_here():
                return None
            t._record.passed_on = True
            return t._value
        held = calls.held_value(owner, t, grad)
        if held is not None:
            self._mark_passed_on(calls, held)
        return held

    def _mark_passed_on(self, calls: MicrobatchCalls, value: ValueId) -> None:
        if value[1] == "out":
            source = calls.records.get(value[0])
            if source is not None:
                source.passed_on = True

    def _decode_outputs(self, calls: MicrobatchCalls, record: CallRecord, reply: Message, grad: bool) -> list:
        """Real tensors (eager reply) attached through RemoteOutputs, or RemoteTensor placeholders (lazy)."""
        specs = reply.meta["outputs"]
        values = [(record.call_id, "out", j) for j in range(len(specs))]
        if reply.meta["lazy"]:
            return [RemoteTensor(self, record, v, shape, dtype, self.device, grad and diff)
                    for v, (shape, dtype, diff) in zip(values, specs)]  # fmt: skip
        outputs = list(reply.tensors)
        for v, o in zip(values, outputs):
            calls.remember(record.owner, o, v, False)
        differentiable = [j for j, (_, _, diff) in enumerate(specs) if grad and diff]
        if differentiable:
            record.out_values = [values[j] for j in differentiable]
            attached = RemoteOutputs.apply(self, record, [outputs[j] for j in differentiable], anchor())
            for j, t in zip(differentiable, attached):
                calls.remember(record.owner, t, values[j], True)
                outputs[j] = t
        return outputs

    def fetch(self, remote: RemoteTensor) -> torch.Tensor:
        """Bring a value that stayed on its owner here, because this rank uses it after all."""
        ctx = context()
        record = remote._record
        self._lazy_sites.discard(record.site)
        request = (self.rank, next(self._seq))
        self._send(record.owner, "get", {"req": request, "mb": record.microbatch, "value": remote._value})
        reply = self._await(ctx, request, f"the value of {record.description}")
        if "error" in reply.meta:
            raise RemoteError(reply.meta["error"])
        (data,) = reply.tensors
        if not remote.requires_grad:
            return data
        sub = CallRecord(record.call_id, record.owner, record.microbatch, record.site, record.description, [],
                         out_values=[remote._value])  # fmt: skip
        (attached,) = RemoteOutputs.apply(self, sub, [data], anchor())
        return attached

    def _await(self, ctx: Context | None, key: tuple[int, int], what: str) -> Message:
        if ctx is None:
            raise StepUsageError(f"{what} is needed outside a microbatch of an @smp.step function.")
        self._waiting[key] = ctx.task
        priority, ctx.task.priority = ctx.task.priority, (CONTINUE, ctx.microbatch)
        try:
            return self.scheduler.block(ctx.task, what)
        finally:
            ctx.task.priority = priority

    def _end_microbatch(self, mb: int, step: int | None = None, learn: bool = True) -> None:
        """Learn which call sites only pass results on, and let owners drop this microbatch's values.

        ``step``: a release's step; a release rides on the next message to its owner, which may belong to the
        next step (a rank 0 -> 1 -> 0 call chain), when the record of that microbatch is a newer one.
        """
        calls = self._mb_calls.get(mb)
        if calls is None or (step is not None and calls.step != step):
            return
        del self._mb_calls[mb]
        learn = learn and self._abort is None  # an unwound microbatch did not show what its results are for
        for record in calls.records.values():
            if learn and record.passed_on and not record.triggered:
                self._lazy_sites.add(record.site)
        for owner in sorted({r.owner for r in calls.records.values()}):
            self._releases.setdefault(owner, []).append((calls.step, mb))  # rides on the next message to owner

    def _send(self, dst: int, kind: str, meta: dict[str, Any] | None = None, tensors: list[torch.Tensor] = ()) -> None:
        """Send, with the microbatches ``dst`` may now forget attached (each message costs ~0.1 ms on gloo).

        While a failed step ends, tasks unwind and only the abort markers go out."""
        if self._abort is not None and kind != ABORT:
            return
        meta = dict(meta or {})
        releases = self._releases.pop(dst, None)
        if releases:
            meta["release"] = releases
        self.transport.send(dst, kind, meta, tensors)

    # ------------------------------------------------------------------ owner side
    def _handle(self, message: Message) -> None:
        """Runs in whichever thread holds the baton: turn a message into wake-ups or new tasks."""
        kind, meta = message.kind, message.meta
        if self._abort is not None and not self._handles_while_aborting(message):
            return
        for step, mb in meta.get("release", ()):  # the sender's earlier microbatches are over
            hosted = self._hosted.get((message.src, mb))
            if hosted is not None and hosted.step == step:
                del self._hosted[(message.src, mb)]
            self._end_microbatch(mb, step, learn=self.lockstep is None)  # arrival order must not steer lockstep
        if kind in ("fwd_ok", "fwd_err", "got"):
            self.scheduler.wake(self._waiting.pop(meta.get("call", meta.get("req"))), message)
        elif kind == "fwd":
            self._spawn(message, SERVE_FORWARD, self._serve_forward)
        elif kind == "bwd":
            self._spawn(message, SERVE_BACKWARD, self._serve_backward)
        elif kind == "get":
            self._serve_get(message)
        elif kind in ("bwd_ok", "bwd_err"):
            driver = self._requests.pop(meta["req"])
            self._request_owner.pop(meta["req"], None)
            driver.replies[meta["req"]] = message
            if driver.waiting:
                self.scheduler.wake(driver.task)
        elif kind == DECISION:
            self.lockstep.receive(message)
        elif kind == "end_step":
            self._end_step = message
            if self.scheduler.root is not None:
                self.scheduler.wake(self.scheduler.root, message)
        elif kind == ABORT:
            self._receive_abort(message.src, meta)
        elif kind == "transport_error" and self._broken is None:  # after a lost peer: the same news again
            self._lose_connection(f"pipeline transport on rank {self.rank} failed", f": {meta['error']}", exits=False)
        elif kind == "peer_closed" and self._end_step is None:  # handled only in a step: one that needs the peer
            self._peer_left(message.src)

    # ------------------------------------------------------------------ steps
    def run_step(self, step_fn: Any, call: StepCall, microbatches: list[tuple[tuple, dict]]) -> list[Any]:
        """One ``@smp.step`` call: pp_rank 0 drives the microbatches, the other ranks serve until told to stop."""
        self._require_usable()
        root = self.scheduler.adopt("step")
        self._step_number += 1
        self._replay_deferred()
        started = timeline.now()
        if self._ordered is not None:
            self._ordered.begin_step()
        if self._rng is not None:
            self._rng.begin_step()
        try:
            if self.pp_rank == 0:
                outputs = self._drive_step(root, step_fn, call, microbatches)
            else:
                outputs = self._serve_step(root)
        finally:
            self.add_late_weights()
            if self._rng is not None:
                self._rng.switch(None)  # the caller's own stream, also when the step failed
            if self._ordered is not None:
                self._ordered.end_step()  # a failed step leaves its gradients as plain accumulation would
            self.scheduler.release_root()
            self._step = None
        recorder = timeline.current()
        if recorder is not None:
            recorder.add_step(started, timeline.now())
        return outputs

    def _drive_step(self, root: Task, step_fn: Any, call: StepCall, microbatches: list[tuple[tuple, dict]]) -> list[Any]:
        run = StepRun(self, step_fn, call, microbatches, root)
        self._step = run
        run.start_more()
        self._wait_as_root(root, "microbatches of this step to finish", lambda: run.finished == len(microbatches))
        skeleton, tensors = flatten_tensors(run.outputs)
        tensors = [t.detach() for t in tensors]
        for peer in self.pp_members:
            if peer != self.rank:
                self._send(peer, "end_step", {"skeleton": skeleton, "backward": self.model._backward_ran}, tensors)
        return run.outputs

    def _serve_step(self, root: Task) -> list[Any]:
        self._wait_as_root(root, "rank 0 to finish the step", lambda: self._end_step is not None)
        message, self._end_step = self._end_step, None
        self.model._backward_ran = message.meta["backward"]  # only pp_rank 0 sees model.backward calls
        return fill_tensors(message.meta["skeleton"], message.tensors)

    def close(self) -> None:
        """Stop the transport threads (every pipeline rank, at shutdown)."""
        if not self._closed:
            self._closed = True
            self.transport.close()
            if self.lockstep is not None:
                self.lockstep.close()
            self.scheduler.close()

    @property
    def bytes_sent(self) -> int:
        return self.transport.payload_bytes


# ---------------------------------------------------------------------- helpers
def _refuse_recomputation(engine: PipelineEngine, target: tuple[Any, ...]) -> None:
    """A forward call to another rank from inside a backward pass is a checkpoint's recomputation crossing ranks:
    its replies would land in the middle of the backward's own bookkeeping (gradients went missing)."""
    raise SMPUnsupportedError(
        f"{engine._describe(target)} lives on another pipeline rank and was called during a backward pass: "
        "torch.utils.checkpoint around a call to a module on another rank recomputes that call, which the "
        "pipeline does not support (nor did SMP). Use smp.set_activation_checkpointing(module) or smp.checkpoint, "
        "which checkpoint on the module's own rank."
    )


def _require_context(engine: PipelineEngine, target: tuple[Any, ...]) -> Context:
    ctx = context()
    if ctx is None:
        raise StepUsageError(
            f"{engine._describe(target)} lives on another pipeline rank and was called outside the step "
            "function's microbatch. Call the model only inside an @smp.step function."
        )
    return ctx
