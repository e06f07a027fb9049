"""The owner side of the pipeline engine: serve forward, backward and fetch requests for this rank's modules.

A served request runs as its own task (forwards before backwards, each kind in arrival order). Its
inputs are kept as *values* per (caller, microbatch), so later calls and the backward can refer to them;
an error is sent back to the caller with this rank's traceback, never raised here.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from contextlib import AbstractContextManager
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from smp_compat.memory.activation_checkpointing import run_checkpointed
from smp_compat.runtime import hf_state
from smp_compat.runtime import late_weights
from smp_compat.runtime.late_weights import Entry, WeightGradients, accumulate, splitting_linears
from smp_compat.runtime.remote import CallId, Context, Hosted, ReceivedInputs, anchor, set_context
from smp_compat.runtime.structure import fill_tensors, flatten_tensors
from smp_compat.runtime.tasks import SERVE_FORWARD, WEIGHTS, Scheduler, Task
from smp_compat.runtime.thread_state import autocast_as
from smp_compat.runtime.messages import Message
from smp_compat.failure import RootCause, root_of
from smp_compat.stepping.step import set_current_microbatch

__all__ = ["ServingSide"]


class ServingSide:
    """The serving half of ``PipelineEngine`` (a mixin): what a rank does when another rank calls its modules.

    The engine provides the state and the caller-side methods used here: ``_send``, ``run_target``,
    ``_describe`` and ``_drive_backward``.
    """

    rank: int
    scheduler: Scheduler
    _hosted: dict[tuple[int, int], Hosted]
    _step_number: int
    _arrivals: Iterator[int]
    _served_from: collections.defaultdict[int, Iterator[int]]
    pp_members: list[int]
    placement: Any
    root: nn.Module
    _late_weights_on: bool
    _widest: dict[tuple[Any, ...], int]
    _left_weights: tuple[list[Entry], Task] | None  # one served backward's weight gradients, left for an idle moment

    if TYPE_CHECKING:

        def _send(self, dst: int, kind: str, meta: dict[str, Any] | None = None,
                  tensors: list[torch.Tensor] = ()) -> None: ...  # fmt: skip

        def run_target(self, target: tuple[Any, ...], args: tuple, kwargs: dict) -> Any: ...

        def _describe(self, target: tuple[Any, ...]) -> str: ...

        def _drive_backward(self, ctx: Context, roots: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None: ...

    def _serve_get(self, message: Message) -> None:
        hosted = self._hosted.get((message.src, message.meta["mb"]))
        value = hosted.values.get(message.meta["value"]) if hosted else None
        if value is None:
            error = (f"rank {self.rank} no longer holds a result of microbatch {message.meta['mb']}: a result that "
                     "stayed remote can only be used inside its microbatch (or returned from the step function)")
            self._send(message.src, "got", {"req": message.meta["req"], "error": error})
            return
        self._send(message.src, "got", {"req": message.meta["req"]}, [value.detach()])

    def _spawn(self, message: Message, priority_class: int, serve: Callable[[Task, Message], None]) -> None:
        """A task for a served request: forwards before backwards (a forward reply is what rank 0 waits
        on for its loss), each kind in arrival order."""
        mb = message.meta["mb"]
        forward = priority_class == SERVE_FORWARD
        task = Task(f"serve-{'fwd' if forward else 'bwd'}-mb{mb}", None, (priority_class, next(self._arrivals)), mb)
        task.phase = "forward" if forward else "backward"
        if self.scheduler.lockstep is not None:  # the n-th request from a stage names it in every tp pipeline
            task.key = ("serve", self.pp_members.index(message.src), next(self._served_from[message.src]))
        task.fn = lambda: serve(task, message)
        self.scheduler.spawn(task)

    def _serve_forward(self, task: Task, message: Message) -> None:
        meta = message.meta
        call_id, mb = meta["call"], meta["mb"]
        description = f"{self._describe(meta['target'])} (microbatch {mb}, forward, called by rank {message.src})"
        hosted = self._hosted.get((message.src, mb))
        if hosted is None or hosted.step != self._step_number:  # the last step's, if its release is still to come
            hosted = self._hosted[(message.src, mb)] = Hosted(self._step_number)
        set_context(Context(task, mb))
        set_current_microbatch(mb)
        try:
            inputs = self._decode_inputs(hosted, call_id, meta["inputs"], message.tensors)
            args, kwargs = fill_tensors(meta["skeleton"], inputs)
            capture = meta.get("capture")
            collecting = hf_state.collecting(capture, self.root)
            late = self._late_linears(hosted, meta, inputs)
            with torch.set_grad_enabled(meta["grad"]), autocast_as(meta["amp"]), collecting as got, late:
                module = self.placement.modules[meta["target"][1]]
                result = run_checkpointed(self.run_target, meta["checkpoint"], module, meta["target"], args, kwargs)
            if capture:  # Hugging Face outputs collected by hooks travel with the result
                result = (result, hf_state.new_entries(capture, got) if got is not None else {})
            skeleton, outputs = flatten_tensors(result)
        except BaseException as exc:  # noqa: BLE001 - the caller raises it with this rank's traceback
            root = root_of(exc, self.rank, self._describe(meta["target"]), f"microbatch {mb}, forward")
            self._reply_error(message, "fwd_err", "call", description, root)
            return
        specs = []
        hosted.descriptions[call_id] = self._describe(meta["target"])
        for j, o in enumerate(outputs):
            hosted.values[(call_id, "out", j)] = o
            specs.append((tuple(o.shape), o.dtype, meta["grad"] and o.requires_grad))
        reply = {"call": call_id, "skeleton": skeleton, "outputs": specs, "lazy": meta["lazy"]}
        self._send(message.src, "fwd_ok", reply, [] if meta["lazy"] else outputs)

    def _late_linears(self, hosted: Hosted, meta: dict[str, Any], inputs: list[Any]) -> AbstractContextManager[Any]:
        """Linear layers whose weight gradients wait until the backward's reply is sent, where some may be
        large enough (the mode costs ~10 us per operation: not spent on calls whose products are all small)."""
        if not self._late_weights_on or not meta["grad"] or meta["checkpoint"]:
            return contextlib.nullcontext()
        largest_input = max((t.numel() for t in inputs if isinstance(t, torch.Tensor)), default=0)
        if largest_input * self._widest_weight(meta["target"]) < late_weights.MIN_MULTIPLY_ADDS:
            return contextlib.nullcontext()
        if hosted.late is None:
            hosted.late = WeightGradients()
        return splitting_linears(hosted.late)

    def _widest_weight(self, target: tuple[Any, ...]) -> int:
        """The most rows of a matrix parameter the call target holds (what a product's output width can be)."""
        widest = self._widest.get(target)
        if widest is None:
            module = self.placement.modules[target[1]]
            modules = [module] if target[0] == "module" else list(module)[target[2] : target[3]]
            rows = [p.shape[0] for m in modules for p in m.parameters() if p.dim() == 2]
            widest = self._widest[target] = max(rows, default=0)
        return widest

    def _decode_inputs(self, hosted: Hosted, call_id: CallId, specs: list[tuple], data: list[torch.Tensor]) -> list:
        """The call's inputs: data received now, or values held already. A tensor passed twice in one call
        (``attn(h, h, h)``) comes once, and the later places refer to the first (attached) one."""
        inputs = [None if spec[0] == "ref" else data[spec[1]] for spec in specs]
        needs_grad = [i for i, spec in enumerate(specs) if spec[0] == "data" and spec[2]]
        if needs_grad:
            ids = [(call_id, "in", i) for i in needs_grad]
            with torch.enable_grad():
                attached = ReceivedInputs.apply(hosted.input_grads, ids, [inputs[i] for i in needs_grad], anchor())
            for i, t in zip(needs_grad, attached):
                inputs[i] = t
        for i, spec in enumerate(specs):
            if spec[0] == "data":
                hosted.values[(call_id, "in", i)] = inputs[i]
        return [hosted.values[spec[1]] if spec[0] == "ref" else t for spec, t in zip(specs, inputs)]

    def _serve_backward(self, task: Task, message: Message) -> None:
        meta = message.meta
        hosted = self._hosted[(message.src, meta["mb"])]
        set_context(Context(task, meta["mb"]))
        set_current_microbatch(meta["mb"])
        late = hosted.late
        try:
            roots = [hosted.values[v] for v in meta["values"]]
            if late is not None:
                late.collecting = True
            self._drive_backward(Context(task, meta["mb"]), roots, list(message.tensors))
        except BaseException as exc:  # noqa: BLE001 - the caller raises it with this rank's traceback
            # the backward runs through every module of this rank it reaches from these outputs: which of
            # them raised is in the traceback, not known here
            modules = ", ".join(repr(m) for m in sorted({hosted.descriptions.get(v[0], "?") for v in meta["values"]}))
            where = f"microbatch {meta['mb']}, backward from the output of {modules}"
            root = root_of(exc, self.rank, None, where)
            self._reply_error(message, "bwd_err", "req", where, root)
            return
        finally:
            if late is not None:
                late.collecting = False
        inputs, grads = hosted.collect_input_grads()
        self._send(message.src, "bwd_ok", {"req": meta["req"], "inputs": inputs}, grads)
        if late is not None:  # the caller goes on with these input gradients meanwhile
            self._leave_weights(late.take(), meta["mb"])

    def _leave_weights(self, entries: list[Entry], mb: int) -> None:
        """Weight gradients for a task that runs when nothing else can (a later served backward first: its
        caller waits for it). At most one backward's are left waiting: the one before is added now (left to
        wait, a busy rank piled them up, and their tensors with them: 1.5x the peak activation memory)."""
        if not entries:
            return
        if self._left_weights is not None:
            waiting, task = self._left_weights
            self._add_weights(waiting)
        else:
            task = Task("", self._add_left_weights, (WEIGHTS, next(self._arrivals)))
            task.phase = "backward"
            self.scheduler.spawn(task)
        task.name, task.microbatch = f"weights-mb{mb}", mb  # the timeline names the backward it finishes
        self._left_weights = (entries, task)

    def _add_left_weights(self) -> None:
        left, self._left_weights = self._left_weights, None
        if left is not None:
            self._add_weights(left[0])

    def _add_weights(self, entries: list[Entry]) -> None:
        """No task waits for this work, so its failure fails the step (a gradient must not go missing)."""
        try:
            accumulate(entries)
        except BaseException as exc:  # noqa: BLE001 - raised by the step's root task, on every rank
            self.scheduler.fail(exc)

    def add_late_weights(self) -> None:
        """Before a step returns, also a failed one (the optimizer reads ``.grad`` next; a failed step leaves its
        gradients as plain accumulation would): the weight gradients left waiting, and not their task."""
        for task in [t for t in self.scheduler.tasks if t.priority[0] == WEIGHTS and not t.started]:
            self.scheduler.tasks.remove(task)
        left, self._left_weights = self._left_weights, None
        if left is not None:
            accumulate(left[0])

    def _reply_error(self, message: Message, kind: str, key: str, description: str, root: RootCause) -> None:
        text = f"rank {self.rank}, {description}:\n{traceback.format_exc()}"  # the caller raises it
        self._send(message.src, kind, {key: message.meta[key], "error": text, "root": root})
