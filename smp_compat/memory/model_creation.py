"""``smp.model_creation`` and ``smp.delay_param_initialization``: build big models without materializing them.

Under delayed initialization only *parameters* go to the meta device (no memory): each parameter is moved
there as a module registers it. Buffers stay real, so constants a module computes in ``__init__`` (a
causal mask, rotary frequencies) keep their values. When the model is partitioned, each rank allocates the
parameters it owns and replays their initializers (see ``smp_compat.memory.materialize``).

A delayed parameter is a ``DelayedParameter``: it records the module that created it (that module's
initializer owns a tied weight) and every write into it. A write made by an initializer that will be
replayed (``reset_parameters``, ``_reset_parameters``, a ``transformers`` model's ``_init_weights``) is
replayed; any other write (``nn.init.normal_(p)`` in a script, a custom init loop) cannot be, and the
parameter is reported when it is materialized.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn

from smp_compat.globalstate import state

__all__ = [
    "DelayedParameter",
    "delay_param_initialization",
    "is_delayed",
    "model_creation",
    "replace_in_place",
    "replaying",
]

REPLAYED_INITIALIZERS = ("reset_parameters", "_reset_parameters", "_init_weights")
_NOT_WRITES = {"requires_grad_", "share_memory_", "detach_"}
_IN_PLACE_OPERATORS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"}
_depth = 0
_replaying = 0
_original_register_parameter = nn.Module.register_parameter


class DelayedParameter(nn.Parameter):
    """A parameter on the meta device that remembers its creator and whether its last write is replayed.

    ``_smp_creator``: the module that registered it first. ``_smp_unreplayed``: True when the last write
    into it came from code that materialization does not replay.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = _write_target(func, args, kwargs)
        if target is not None and not _replaying:
            target._smp_unreplayed = not _replayed_here(target)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func == torch.Tensor.data.__get__ and isinstance(args[0], DelayedParameter):
            out = out.as_subclass(_DelayedView)  # so that p.data.normal_() is seen too
            out._smp_origin = args[0]
        return out


class _DelayedView(torch.Tensor):
    """``p.data`` of a delayed parameter: writes into it are writes into ``p``."""

    __torch_function__ = DelayedParameter.__torch_function__


def _write_target(func: Any, args: tuple, kwargs: dict) -> DelayedParameter | None:
    """The delayed parameter ``func`` writes into in place, if any (``nn.init`` passes it as ``tensor=``)."""
    name = getattr(func, "__name__", "")
    writes = name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
    if not writes or name in _NOT_WRITES:
        return None
    target = args[0] if args else kwargs.get("tensor")
    if isinstance(target, _DelayedView):
        target = target._smp_origin
    return target if isinstance(target, DelayedParameter) else None


def _replayed_here(param: DelayedParameter) -> bool:
    """True if an initializer that materialization replays, of a module holding ``param``, is on the stack."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_name
        if name in REPLAYED_INITIALIZERS:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and _replays(owner, name, param):
                return True
        frame = frame.f_back
    return False


def _replays(module: nn.Module, method: str, param: torch.Tensor) -> bool:
    if method == "_init_weights":  # a transformers model's: replayed over its whole tree
        return is_hf_model(module)
    return torch_initializer_name(module) == method and any(p is param for p in module.parameters())


def is_hf_model(module: nn.Module) -> bool:
    """True for a ``transformers`` ``PreTrainedModel`` (whose ``_init_weights`` is replayed)."""
    modeling = sys.modules.get("transformers.modeling_utils")  # not imported: no transformers model exists
    base = getattr(modeling, "PreTrainedModel", None) if modeling is not None else None
    return base is not None and isinstance(module, base)


def torch_initializer_name(module: nn.Module) -> str | None:
    """``reset_parameters`` or ``_reset_parameters`` (nn.MultiheadAttention, nn.Transformer), if defined."""
    for name in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, name, None)):
            return name
    return None


def _register_delayed(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """``nn.Module.register_parameter`` inside the context: the parameter moves to meta, same object."""
    _original_register_parameter(module, name, param)
    if param is None or isinstance(param, DelayedParameter) or param.is_meta:
        return
    delayed = DelayedParameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    delayed.__dict__.update(param.__dict__)
    delayed._smp_creator = module
    delayed._smp_unreplayed = False
    try:
        torch.utils.swap_tensors(param, delayed)  # the module and any caller keep the same Python object
    except RuntimeError:  # the parameter has weak references: register the meta one instead
        module._parameters[name] = delayed


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Parameters created inside hold no memory until the model is partitioned; buffers stay real."""
    global _depth
    if not enabled:
        yield
        return
    _depth += 1
    nn.Module.register_parameter = _register_delayed  # type: ignore[method-assign]
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            nn.Module.register_parameter = _original_register_parameter  # type: ignore[method-assign]


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tensor_parallel_config: Any) -> Iterator[None]:
    """Create the model with ``dtype`` as default dtype, delayed when the config asks for it (SMP >= 1.10)."""
    from smp_compat.nn.registry import tensor_parallelism as tp_context  # nn/ is a higher layer

    delayed = bool(state.initialized and state.cfg.delayed_parameter_initialization)
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        tp = tp_context(True, **tensor_parallel_config) if tensor_parallelism else contextlib.nullcontext()
        with delay_param_initialization(delayed), tp:
            yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """While materializing: writes into delayed parameters are the replay itself, not user writes."""
    global _replaying
    _replaying += 1
    try:
        yield
    finally:
        _replaying -= 1


def is_delayed(root: nn.Module) -> bool:
    """True if some parameter or buffer of ``root`` still lives on the meta device."""
    return any(t.is_meta for t in root.parameters()) or any(t.is_meta for t in root.buffers())


def replace_in_place(t: torch.Tensor, data: torch.Tensor) -> None:
    """Give ``t`` new storage, keeping the Python object, so optimizers built earlier still hold it.

    ``.data =`` cannot turn a meta tensor into a real one; ``swap_tensors`` can. Attributes a script set
    on the parameter are kept (a tensor-parallel shard's markers too); the delayed-initialization bookkeeping
    is dropped.
    """
    if isinstance(t, nn.Parameter):
        data = nn.Parameter(data, requires_grad=t.requires_grad)
        data.__dict__.update({k: v for k, v in t.__dict__.items() if not k.startswith("_smp_") or k.startswith("_smp_tp_")})
    torch.utils.swap_tensors(t, data)
