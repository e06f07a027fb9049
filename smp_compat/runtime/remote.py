"""Remote module calls and their cross-rank autograd, without ever blocking inside autograd.

The graph is cut at every rank boundary. The owner of a module keeps, per (caller, microbatch),
every tensor a call received or produced as a *value*: a later call may refer to a value instead
of sending its data again (results rank 0 only passes on stay where they are). Received tensors
that need gradients come out of ``ReceivedInputs``, whose backward keeps their gradients for the caller.

Backward: a remote call's outputs come back through ``RemoteOutputs``, whose backward only *sends*
the output gradients to the owner. The task that drives the backward then waits, outside
autograd, for the owner's reply (the gradients its received inputs collected) and runs the next local
segment from the caller's tensors that those inputs stand for. So autograd never waits on the
network, also on CUDA where it runs on device threads.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from smp_compat.runtime.late_weights import WeightGradients
    from smp_compat.runtime.tasks import Task

__all__ = [
    "CallId", "ValueId", "CallRecord", "MicrobatchCalls", "Hosted", "Driver", "RemoteOutputs", "ReceivedInputs",
    "RemoteTensor", "anchor", "context", "set_context",
]  # fmt: skip

CallId = tuple[int, int]  # (caller rank, sequence number): unique in the job
ValueId = tuple[CallId, str, int]  # (call, "in" | "out", position)


@dataclass
class CallRecord:
    """Caller side of one remote call, kept until the microbatch ends."""

    call_id: CallId
    owner: int
    microbatch: int
    site: tuple[Any, ...]
    description: str
    grad_inputs: list[torch.Tensor | None]  # the caller's tensors behind the owner's received inputs ("in", i)
    out_values: list[ValueId] = field(default_factory=list)  # differentiable outputs
    triggered: bool = False  # an output got a gradient on this rank
    passed_on: bool = False  # an output was handed back to the owner as a reference


@dataclass
class MicrobatchCalls:
    """The remote calls this rank made for one microbatch, and what each owner already holds."""

    microbatch: int
    step: int  # the engine's step number: a release that arrives a step late must not end a newer record
    records: dict[CallId, CallRecord] = field(default_factory=dict)
    # owner -> id(tensor) -> (weak ref, version, the owner's value, whether that value passes gradient back)
    held: dict[int, dict[int, tuple[Any, int, ValueId, bool]]] = field(default_factory=dict)
    site_counts: dict[Any, int] = field(default_factory=dict)

    def held_value(self, owner: int, tensor: torch.Tensor, grad: bool) -> ValueId | None:
        """The owner's value for ``tensor`` if it already has it (same object, not modified since) and, when the
        call records gradients, it passes them back exactly when ``tensor`` wants them: a copy sent under
        ``no_grad`` cannot stand for the tensor in a call with grad, nor an attached one after ``detach_()``."""
        entry = self.held.get(owner, {}).get(id(tensor))
        if entry is None:
            return None
        ref, version, value, connected = entry
        if ref() is not tensor or tensor._version != version:
            return None
        return value if not grad or connected == tensor.requires_grad else None

    def remember(self, owner: int, tensor: torch.Tensor, value: ValueId, connected: bool) -> None:
        if tensor.is_inference():  # no version counter to tell an in-place change: always sent again
            return
        self.held.setdefault(owner, {})[id(tensor)] = (weakref.ref(tensor), tensor._version, value, connected)


@dataclass
class Hosted:
    """Owner side: the values one caller's calls of one microbatch received or produced here."""

    step: int  # as MicrobatchCalls.step
    values: dict[ValueId, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[ValueId, torch.Tensor] = field(default_factory=dict)  # filled by ReceivedInputs.backward
    descriptions: dict[CallId, str] = field(default_factory=dict)  # module names, for error messages
    late: WeightGradients | None = None  # weight gradients computed after the reply (late_weights.py)

    def collect_input_grads(self) -> tuple[list[ValueId], list[torch.Tensor]]:
        """Gradients the received inputs gathered since the last collection (then cleared: report each once)."""
        ids, grads = list(self.input_grads), list(self.input_grads.values())
        self.input_grads.clear()
        return ids, grads


@dataclass
class Driver:
    """One task driving a backward: the gradient requests it waits for and the replies that came."""

    task: Task
    outstanding: set[tuple[int, int]] = field(default_factory=set)
    replies: dict[tuple[int, int], Any] = field(default_factory=dict)
    waiting: bool = False


class RemoteOutputs(torch.autograd.Function):
    """Identity on received outputs whose backward hands their gradients to the engine."""

    @staticmethod
    def forward(ctx: Any, engine: Any, record: CallRecord, outputs: list[torch.Tensor], anchor: torch.Tensor) -> Any:
        ctx.engine, ctx.record = engine, record
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(o for o in outputs if not o.is_floating_point()))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.engine.send_output_grads(ctx.record, list(grads))
        return None, None, None, None


class ReceivedInputs(torch.autograd.Function):
    """Identity on a call's received inputs that need gradients; its backward keeps their gradients.

    Not leaves: a served module may change its input in place (``nn.ReLU(inplace=True)`` first), which
    autograd refuses on a leaf that requires grad. ``sink`` is the ``Hosted.input_grads`` dict (not the
    ``Hosted``, whose values hold these outputs: that would be a reference cycle).
    """

    @staticmethod
    def forward(ctx: Any, sink: dict, ids: list[ValueId], inputs: list[torch.Tensor], anchor: torch.Tensor) -> Any:
        ctx.sink, ctx.ids = sink, ids
        ctx.set_materialize_grads(False)
        return tuple(inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        for value_id, g in zip(ctx.ids, grads):
            if g is not None:
                held = ctx.sink.get(value_id)
                ctx.sink[value_id] = g if held is None else held + g
        return None, None, None, None


_ANCHOR: list[torch.Tensor] = []


def anchor() -> torch.Tensor:
    """A leaf that requires grad, so an identity Function above is recorded by autograd even though no
    tensor argument of it needs grad."""
    if not _ANCHOR:
        _ANCHOR.append(torch.zeros((), device="cpu", requires_grad=True))  # not on a default device set by a mode
    return _ANCHOR[0]


class RemoteTensor(torch.Tensor):
    """A result that stays on its owner: metadata here, data fetched only if this rank uses it."""

    _engine: Any
    _owner: int
    _value: ValueId
    _record: CallRecord
    _fetched: torch.Tensor | None
    _fetched_version: int

    @staticmethod
    def __new__(cls, engine: Any, record: CallRecord, value: ValueId, shape: Any, dtype: torch.dtype,
                device: torch.device, requires_grad: bool) -> RemoteTensor:  # fmt: skip
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t._engine, t._owner, t._value, t._record, t._fetched = engine, record.owner, value, record, None
        t._fetched_version = 0
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"RemoteTensor(rank {self._owner}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def materialize(self) -> torch.Tensor:
        if self._fetched is None:
            self._fetched = self._engine.fetch(self)
            self._fetched_version = self._fetched._version
        return self._fetched

    def changed_here(self) -> bool:
        """Whether this rank changed its fetched copy in place: the owner's value is then out of date."""
        return self._fetched is not None and self._fetched._version != self._fetched_version

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        from torch.utils._pytree import tree_map

        real = tree_map(lambda x: x.materialize() if isinstance(x, RemoteTensor) else x, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*real[0], **real[1])


    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Below autograd; reached only by ops __torch_function__ did not see: run them on the data."""
        from torch.utils._pytree import tree_map

        real = tree_map(lambda x: x.materialize().detach() if isinstance(x, RemoteTensor) else x, (args, kwargs or {}))
        return func(*real[0], **real[1])


_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
    torch.Tensor.is_floating_point, torch.Tensor.element_size,
}  # fmt: skip


_local = threading.local()


@dataclass
class Context:
    """What the running task is doing: which task, which microbatch."""

    task: Task
    microbatch: int


def context() -> Context | None:
    return getattr(_local, "ctx", None)


def set_context(ctx: Context | None) -> None:
    _local.ctx = ctx

