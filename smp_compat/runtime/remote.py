"""Remote module calls and their cross-rank autograd, without ever blocking inside autograd.

The graph is cut at every rank boundary: a remote call sends detached inputs and keeps the
caller's graph-attached inputs; its outputs come back through ``RemoteOutputs``, whose backward
only *sends* the output gradients to the owner. The task that started the backward then waits
(outside autograd) for the owner's input gradients and runs the next local segment from them.
So autograd never waits on the network, also on CUDA where it runs on device threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from smp_compat.runtime.tasks import Task

__all__ = ["CallRecord", "Scope", "ServedCall", "RemoteOutputs", "context", "set_context", "amp_state"]

CallId = tuple[int, int]


@dataclass
class Scope:
    """Backward bookkeeping of one microbatch (pp_rank 0) or one served call: the remote calls it made."""

    microbatch: int
    calls: dict[CallId, CallRecord] = field(default_factory=dict)
    outstanding: set[CallId] = field(default_factory=set)
    responses: dict[CallId, list[torch.Tensor | None]] = field(default_factory=dict)
    waiting_task: Task | None = None


@dataclass
class CallRecord:
    """Caller side of one remote call that produced differentiable outputs."""

    call_id: CallId
    owner: int
    scope: Scope
    grad_inputs: list[torch.Tensor | None]
    differentiable: list[bool]
    description: str
    received: list[torch.Tensor] = field(default_factory=list)
    triggered: bool = False


@dataclass
class ServedCall:
    """Owner side of one remote call, kept until its backward (or release)."""

    call_id: CallId
    caller: int
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    scope: Scope
    description: str


class RemoteOutputs(torch.autograd.Function):
    """Identity on the received outputs whose backward hands the gradients to the engine."""

    @staticmethod
    def forward(ctx: Any, engine: Any, record: CallRecord, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.engine, ctx.record = engine, record
        ctx.set_materialize_grads(False)
        outputs = tuple(record.received)
        record.received = []
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, record.differentiable) if not d))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.engine.send_output_grads(ctx.record, list(grads))
        return None, None, None


_local = threading.local()


@dataclass
class Context:
    """What the running task is doing: which task, whose backward bookkeeping, which microbatch."""

    task: Task
    scope: Scope


def context() -> Context | None:
    return getattr(_local, "ctx", None)


def set_context(ctx: Context | None) -> None:
    _local.ctx = ctx


def amp_state() -> dict[str, tuple[bool, torch.dtype]]:
    """The caller's autocast settings, so modules executed on other ranks run under the same ones."""
    state = {}
    for device_type in ("cpu", "cuda"):
        state[device_type] = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    return state
