"""Activation checkpointing: ``smp.set_activation_checkpointing``, ``smp.checkpoint``, ``checkpoint_sequential``.

A checkpointed module keeps only its inputs in forward and recomputes its activations in backward
(torch's non-reentrant checkpoint, which also survives the engine's repeated backward segments). It
runs where the module runs: on the module's pipeline rank, so the recomputation never crosses ranks.
A module whose subtree spans ranks cannot be checkpointed as one piece; as SMP did, it is skipped
with a warning (a ``nn.Sequential`` falls back to checkpointing each child).
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from smp_compat.errors import PartitionError, SMPConfigError, StepUsageError
from smp_compat.globalstate import state
from smp_compat.memory.recompute_buffers import buffer_guard

__all__ = [
    "set_activation_checkpointing", "checkpoint", "checkpoint_sequential", "apply_activation_checkpointing",
    "remote_checkpointing", "requested_checkpointing", "run_checkpointed",
]  # fmt: skip

_GROUP = re.compile(r"group_(\d+)$")


@dataclass(frozen=True)
class _Options:
    preserve_rng_state: bool
    strategy: str


_marked: weakref.WeakKeyDictionary[nn.Module, _Options] = weakref.WeakKeyDictionary()


def set_activation_checkpointing(
    module: nn.Module, preserve_rng_state: bool = True, pack_args_as_tuple: bool = False, strategy: str = "each"
) -> None:
    """Mark ``module`` (after wrapping the model) to recompute its activations in backward."""
    model = state.model
    if model is None:
        raise StepUsageError(
            "smp.set_activation_checkpointing() must be called after smp.DistributedModel(...) has wrapped the "
            "model, as in SMP."
        )
    if not any(m is module for m in model.module.modules()):
        raise SMPConfigError("smp.set_activation_checkpointing() got a module that is not part of the DistributedModel.")
    _check_strategy(module, strategy)
    if pack_args_as_tuple:
        warnings.warn("pack_args_as_tuple is deprecated in SMP and has no effect.", DeprecationWarning, stacklevel=2)
    _marked[module] = _Options(preserve_rng_state, strategy)
    if model.partitioned:
        _apply(module, _marked[module], model)


def _check_strategy(module: nn.Module, strategy: str) -> None:
    if strategy not in ("each", "contiguous") and not _GROUP.match(strategy):
        raise SMPConfigError(f'strategy must be "each", "contiguous" or "group_<k>", got {strategy!r}.')
    if strategy != "each" and not isinstance(module, nn.Sequential):
        raise SMPConfigError(f"strategy {strategy!r} only applies to nn.Sequential, not {type(module).__name__}.")


def apply_activation_checkpointing(model: Any) -> None:
    """Wrap every marked module's local forward; called once the model is partitioned."""
    for module, options in list(_marked.items()):
        if any(m is module for m in model.module.modules()):
            _apply(module, options, model)


def _execution_rank(model: Any, module: nn.Module) -> int | None:
    """The module's pipeline rank; None for a module without state of its own, which runs on its caller's."""
    engine = model.pipeline_engine
    return 0 if engine is None else engine.placement.rank_of_module(module)


def _spans_ranks(model: Any, module: nn.Module) -> bool:
    """State on more than one pipeline rank below ``module`` (a parameter-free module spans nothing)."""
    engine = model.pipeline_engine
    return engine is not None and engine.placement.spans_ranks(module)


def _apply(module: nn.Module, options: _Options, model: Any) -> None:
    if getattr(module, "_smp_checkpointed", False):
        return
    if isinstance(module, nn.Sequential) and options.strategy != "each":
        if not _spans_ranks(model, module):
            _wrap_local_forward(module, _grouped_forward(module, options))
            return
        warnings.warn(f"{type(module).__name__} spans pipeline ranks: checkpointing each child instead of "
                      f"{options.strategy!r} groups.", stacklevel=3)  # fmt: skip
    if isinstance(module, nn.Sequential) and options.strategy == "each":
        for child in module:
            _apply(child, options, model)
        return
    if _spans_ranks(model, module):
        warnings.warn(f"{type(module).__name__} spans pipeline ranks, so it is not checkpointed (as in SMP); "
                      "checkpoint its children instead.", stacklevel=3)  # fmt: skip
        return
    local, rng = _local_forward(module), options.preserve_rng_state
    _wrap_local_forward(module, lambda *a, **kw: _run_checkpointed(local, rng, (module,), *a, **kw))


def _local_forward(module: nn.Module) -> Callable[..., Any]:
    return getattr(module, "_smp_local_forward", None) or module.forward


def _wrap_local_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Replace what runs on the module's own rank (behind the engine's dispatch, if any)."""
    if hasattr(module, "_smp_local_forward"):
        module._smp_local_forward = forward
    else:
        module.forward = forward
    module._smp_checkpointed = True


def _run_checkpointed(fn: Callable[..., Any], preserve_rng_state: bool, modules: Sequence[nn.Module], *args: Any,
                      **kwargs: Any) -> Any:  # fmt: skip
    """``fn`` (the forward of ``modules``) checkpointed; its recomputation leaves the modules' buffers alone."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    with _offloading():
        return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                context_fn=buffer_guard(modules), **kwargs)  # fmt: skip


def _offloading() -> contextlib.AbstractContextManager[Any]:
    """``offload_activations`` on CUDA: what a checkpointed region keeps goes to pinned host memory.

    torch brings each tensor back when backward needs it (``activation_loading_horizon``'s prefetch is not
    implemented; the key is accepted).
    """
    if state.initialized and state.cfg.offload_activations and state.device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def _groups(seq: nn.Sequential, strategy: str) -> list[tuple[int, int]]:
    n = len(seq)
    if strategy == "contiguous":
        return [(0, n)]
    k = int(_GROUP.match(strategy).group(1))  # type: ignore[union-attr]
    if k < 1:
        raise SMPConfigError(f"group size must be >= 1 in {strategy!r}.")
    return [(i, min(i + k, n)) for i in range(0, n, k)]


def _grouped_forward(seq: nn.Sequential, options: _Options) -> Callable[..., Any]:
    groups = _groups(seq, options.strategy)

    def forward(x: Any) -> Any:
        children = list(seq)
        for start, stop in groups:

            def run(inp: Any, start: int = start, stop: int = stop) -> Any:
                for child in children[start:stop]:
                    inp = child(inp)
                return inp

            x = _run_checkpointed(run, options.preserve_rng_state, children[start:stop], x)
        return x

    return forward


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True) -> Any:
    """Run one module call with activation checkpointing (SMP's ``smp.checkpoint``; modules only).

    On a module that lives on another pipeline rank, the request asks the owner to checkpoint the call.
    """
    if not isinstance(module, nn.Module):
        raise SMPConfigError("smp.checkpoint() takes a module (SMP does not checkpoint plain functions).")
    model = state.model
    if model is not None and model.partitioned and _spans_ranks(model, module):
        raise PartitionError(
            f"smp.checkpoint() needs the whole {type(module).__name__} on one pipeline rank, but it spans ranks."
        )
    engine = model.pipeline_engine if model is not None else None
    rank = _execution_rank(model, module) if engine is not None else None
    if rank is not None and rank != engine.pp_rank:
        with remote_checkpointing(preserve_rng_state):  # never recompute a remote call inside autograd here
            return module(*args)
    return _run_checkpointed(module, preserve_rng_state, (module,), *args)


_request = threading.local()


@contextlib.contextmanager
def remote_checkpointing(preserve_rng_state: bool) -> Iterator[None]:
    """While active, remote calls made by this thread ask their owner to checkpoint them."""
    previous = getattr(_request, "options", None)
    _request.options = preserve_rng_state
    try:
        yield
    finally:
        _request.options = previous


def requested_checkpointing() -> bool | None:
    """None, or the preserve_rng_state of the enclosing ``smp.checkpoint`` (read by the engine)."""
    return getattr(_request, "options", None)


def run_checkpointed(fn: Callable[..., Any], preserve_rng_state: bool | None, module: nn.Module, *args: Any,
                     **kwargs: Any) -> Any:  # fmt: skip
    """``fn(*args, **kwargs)`` (a call into ``module``), checkpointed when ``preserve_rng_state`` is not None
    (owner side of a request)."""
    if preserve_rng_state is None:
        return fn(*args, **kwargs)
    return _run_checkpointed(fn, preserve_rng_state, (module,), *args, **kwargs)


def checkpoint_sequential(
    sequential_module: nn.Sequential,
    input: Any,  # noqa: A002 - SMP's name
    strategy: str = "each",
    preserve_rng_state: bool = True,
    pack_args_as_tuple: bool = False,
) -> Any:
    """Run an ``nn.Sequential`` with checkpointing by ``strategy``; works when its children span ranks."""
    _check_strategy(sequential_module, strategy)
    if strategy == "each":
        for child in sequential_module:
            input = checkpoint(child, input, preserve_rng_state=preserve_rng_state)
        return input
    return _grouped_forward(sequential_module, _Options(preserve_rng_state, strategy))(input)
