"""Splitting the arguments of an ``@smp.step`` call into per-microbatch arguments (SMP_REFERENCE §4.1)."""

from __future__ import annotations

import argparse
import enum
import functools
import numbers
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils.data

from smp_compat.errors import SMPConfigError, TensorSplitError
from smp_compat.stepping.signature import Params, func_name, params_of
from smp_compat.stepping.output import (
    MAPPING,
    NAMEDTUPLE,
    SET,
    StepOutput,
    container_kind,
    rebuild_mapping,
    rebuild_sequence,
    rebuild_set,
)

__all__ = ["split_step_inputs"]

# Leaf kinds; container kinds (LIST, TUPLE, NAMEDTUPLE, MAPPING, SET = 0..4) come from step_output.
_PLAIN, _TENSOR, _SLICEABLE, _STEP_OUTPUT, _SUSPICIOUS, _OTHER = range(10, 16)

# Values that are naturally shared by every microbatch: passed through without a warning. Scripts pass
# the optimizer and smp.amp.GradScaler into the step (AWS's do); SMP warned about optimizers, we do not.
_PLAIN_TYPES: tuple[type, ...] = (
    numbers.Number, str, bytes, type(None), type(Ellipsis), slice, range, type, enum.Enum,
    torch.device, torch.dtype, torch.layout, torch.memory_format, torch.Generator, torch.Size,
    torch.nn.Module, argparse.Namespace, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
    torch.amp.GradScaler,
    types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial,
)

# Data sources SMP warns about: passing one means the script loads batches inside the step function.
_SUSPICIOUS_TYPES: tuple[tuple[type, str], ...] = (
    (torch.utils.data.DataLoader,
     "Iterate the DataLoader outside the step function and pass each batch's tensors to it."),
    (torch.utils.data.Dataset,
     "Load batches outside the step function and pass each batch's tensors to it."),
    (torch.utils.data.Sampler,
     "Load batches outside the step function and pass each batch's tensors to it."),
)

# Attributes that make an object array-like (numpy, cupy, jax...): per-sample data SMP cannot split.
_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__cuda_array_interface__", "__dlpack__")

_KIND: dict[type, int] = {}
_warned: set[tuple[str, type]] = set()

Path = tuple[Any, ...]  # (root name, (code, key), ...): formatted only when a message needs it


def split_step_inputs(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    num_microbatches: int,
    non_split_inputs: Sequence[str] | None = None,
    input_split_axes: Mapping[str, int] | None = None,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Return one ``(args, kwargs)`` per microbatch, following SMP_REFERENCE §4.1.

    Tensors in split arguments become contiguous views (``narrow``) along their batch axis; objects with
    ``smp_slice`` and ``StepOutput``s are resolved per microbatch; everything else, containers without
    anything to split included, is passed as the same object to every microbatch.
    """
    n = _check_num_microbatches(num_microbatches)
    args = tuple(args)
    non_split = frozenset(non_split_inputs or ())
    axes = dict(input_split_axes or {})
    params = params_of(func)
    arg_parts = [
        _walk(value, *_positional_target(params, func, i, args, kwargs, non_split, axes), n)
        for i, value in enumerate(args)
    ]
    kw_parts = {
        key: _walk(value, *_keyword_target(params, func, key, args, kwargs, non_split, axes), n)
        for key, value in kwargs.items()
    }
    if all(p is None for p in arg_parts) and all(p is None for p in kw_parts.values()):
        return [(args, dict(kwargs)) for _ in range(n)]
    return [
        (
            tuple(v if p is None else p[mb] for v, p in zip(args, arg_parts)),
            {k: kwargs[k] if p is None else p[mb] for k, p in kw_parts.items()},
        )
        for mb in range(n)
    ]


def _check_num_microbatches(num_microbatches: Any) -> int:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise SMPConfigError(
            f"The number of microbatches must be an integer >= 1, got {num_microbatches!r}. Set the "
            "'microbatches' config key to a positive integer that divides the per-rank batch size."
        )
    return num_microbatches


def _positional_target(
    params: Params | None, func: Callable[..., Any], i: int, args: tuple[Any, ...],
    kwargs: dict[str, Any], non_split: frozenset[str], axes: dict[str, int],
) -> tuple[Path, bool, int]:
    """(path, split?, axis) for positional argument ``i``."""
    if params is None:
        return (f"positional argument {i}",), True, 0
    if i < len(params.positional):
        name = params.positional[i]
        return (name,), name not in non_split, axes.get(name, 0)
    if params.var_positional is None:
        _raise_bind_error(params, func, args, kwargs)
    name = params.var_positional
    return (name, ("i", i - len(params.positional))), name not in non_split, axes.get(name, 0)


def _keyword_target(
    params: Params | None, func: Callable[..., Any], key: str, args: tuple[Any, ...],
    kwargs: dict[str, Any], non_split: frozenset[str], axes: dict[str, int],
) -> tuple[Path, bool, int]:
    """(path, split?, axis) for keyword argument ``key``; a key caught by ``**kwargs`` may be named itself."""
    if params is None or key in params.keyword:
        return (key,), key not in non_split, axes.get(key, 0)
    var = params.var_keyword
    if var is None:
        _raise_bind_error(params, func, args, kwargs)
    return (key,), key not in non_split and var not in non_split, axes.get(key, axes.get(var, 0))


def _raise_bind_error(
    params: Params, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    params.signature.bind(*args, **kwargs)  # raises the TypeError Python itself would give
    raise TypeError(f"{func_name(func)}{params.signature} cannot take these arguments")


def _walk(value: Any, path: Path, split: bool, axis: int, n: int) -> list[Any] | None:
    """Per-microbatch values of ``value``, or None when every microbatch gets ``value`` itself."""
    cls = type(value)
    kind = _KIND.get(cls)
    if kind is None:
        kind = _KIND[cls] = _classify(cls)
    if kind == _PLAIN:
        return None
    if kind == _TENSOR:
        return _split_tensor(value, path, axis, n) if split and n > 1 else None
    if kind < _PLAIN:
        return _walk_container(value, kind, path, split, axis, n)
    if kind == _SLICEABLE:
        return [value.smp_slice(n, mb, axis) for mb in range(n)]
    if kind == _STEP_OUTPUT:
        return _unpack_step_output(value, path, n)
    if kind == _SUSPICIOUS:
        _warn_suspicious(cls, path)
        return None
    slicer = getattr(value, "smp_slice", None)  # set on the instance rather than the class
    if slicer is not None:
        return [slicer(n, mb, axis) for mb in range(n)]
    if split and n > 1 and _may_hold_batch_data(value):
        _warn_unsplittable(cls, path)
    return None


def _may_hold_batch_data(value: Any) -> bool:
    """Whether splitting ``value`` was plausible: array-like, or holding tensors in its attributes (a batch
    class). Configs, callables, scalers and other objects without tensors are clearly meant to be shared."""
    if any(hasattr(value, name) for name in _ARRAY_PROTOCOLS):
        return True
    if callable(value) or _optimizer_like(value):
        return False
    try:
        attributes = list(vars(value).values())
    except TypeError:  # no __dict__ (slots or a C type)
        attributes = [getattr(value, name, None) for name in getattr(type(value), "__slots__", ())]
    return any(_holds_tensor(attribute) for attribute in attributes)


def _optimizer_like(value: Any) -> bool:
    """An optimizer wrapper (smp's fp16 optimizer, a sharded or scheduled-free one): holds tensors, shares them."""
    return callable(getattr(value, "step", None)) and callable(getattr(value, "zero_grad", None))


def _holds_tensor(attribute: Any) -> bool:
    """A tensor, or a list, tuple or dict with a tensor among its items (one level deep)."""
    if isinstance(attribute, torch.Tensor):
        return True
    if isinstance(attribute, Mapping):
        return any(isinstance(item, torch.Tensor) for item in attribute.values())
    return isinstance(attribute, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in attribute)


def _classify(cls: type) -> int:
    """Leaf or container kind of a type; the order follows SMP's rules 3 to 6."""
    if hasattr(cls, "smp_slice"):
        return _SLICEABLE
    if issubclass(cls, StepOutput):
        return _STEP_OUTPUT
    if issubclass(cls, torch.Tensor):
        return _TENSOR
    if issubclass(cls, tuple(t for t, _ in _SUSPICIOUS_TYPES)):
        return _SUSPICIOUS
    if issubclass(cls, _PLAIN_TYPES):
        return _PLAIN
    kind = container_kind(cls)
    return _OTHER if kind is None else kind


def _walk_container(value: Any, kind: int, path: Path, split: bool, axis: int, n: int) -> list[Any] | None:
    if kind == MAPPING:
        changed = []
        for key, child in value.items():
            parts = _walk(child, (*path, ("k", key)), split, axis, n)
            if parts is not None:
                changed.append((key, parts))
        if not changed:
            return None
        return [rebuild_mapping(value, [(key, parts[mb]) for key, parts in changed]) for mb in range(n)]
    items = list(value)
    if kind == SET:
        keys: list[tuple[str, Any]] = [("s", None)] * len(items)
    elif kind == NAMEDTUPLE:
        keys = [("a", field) for field in value._fields]
    else:
        keys = [("i", i) for i in range(len(items))]
    all_parts = [_walk(child, (*path, key), split, axis, n) for child, key in zip(items, keys)]
    if all(parts is None for parts in all_parts):
        return None
    per_mb = [
        [child if parts is None else parts[mb] for child, parts in zip(items, all_parts)] for mb in range(n)
    ]
    if kind == SET:
        return [rebuild_set(value, new) for new in per_mb]
    return [rebuild_sequence(value, kind, new) for new in per_mb]


def _split_tensor(tensor: torch.Tensor, path: Path, axis: int, n: int) -> list[torch.Tensor]:
    """Contiguous blocks along ``axis`` (views, no copy), as SMP's ``narrow(axis, mb*k, k)``."""
    ndim = tensor.dim()
    if ndim == 0:
        root, where = path[0], _format_path(path)
        raise TensorSplitError(
            f"Step argument {where} is a 0-dim (scalar) tensor, so it has no batch axis to split into {n} "
            f"microbatches. List {root!r} in non_split_inputs, e.g. @smp.step(non_split_inputs=[{root!r}]), "
            "so that every microbatch receives the whole tensor."
        )
    if not -ndim <= axis < ndim:
        root, where = path[0], _format_path(path)
        raise TensorSplitError(
            f"Step argument {where} has shape {tuple(tensor.shape)} ({ndim} dims), so its split axis {axis} "
            f"is out of range. Set input_split_axes[{root!r}] to its batch axis (from {-ndim} to "
            f"{ndim - 1}), or list {root!r} in non_split_inputs if it has no batch axis."
        )
    size = tensor.shape[axis]
    if size % n:
        root, where = path[0], _format_path(path)
        raise TensorSplitError(
            f"Cannot split step argument {where} (tensor of shape {tuple(tensor.shape)}) into {n} "
            f"microbatches: its size along axis {axis} is {size}, which is not divisible by {n}. Fixes: make "
            f"every batch a multiple of {n} (a batch size divisible by 'microbatches', and "
            "DataLoader(..., drop_last=True) so that the last batch is not smaller); list "
            f"{root!r} in non_split_inputs if it has no batch dimension; or set "
            f"input_split_axes={{{root!r}: <axis>}} if its batch dimension is not axis {axis}."
        )
    k = size // n
    return [tensor.narrow(axis, mb * k, k) for mb in range(n)]


def _unpack_step_output(value: StepOutput, path: Path, n: int) -> list[Any]:
    if len(value.outputs) != n:
        raise TensorSplitError(
            f"Step argument {_format_path(path)} is a StepOutput with {len(value.outputs)} microbatch "
            f"values, but this step runs {n} microbatches. Pass StepOutputs only between step functions "
            "that run the same number of microbatches, or pass so.concat() (a tensor) instead."
        )
    return list(value.outputs)


def _warn_suspicious(cls: type, path: Path) -> None:
    if ("suspicious", cls) in _warned:
        return
    _warned.add(("suspicious", cls))
    advice = next(text for base, text in _SUSPICIOUS_TYPES if issubclass(cls, base))
    warnings.warn(
        f"Step argument {_format_path(path)} is a {_type_name(cls)}; it is passed unchanged to every "
        f"microbatch, and the step function body runs once per microbatch. {advice}",
        stacklevel=4,
    )


def _warn_unsplittable(cls: type, path: Path) -> None:
    if ("unsplittable", cls) in _warned:
        return
    _warned.add(("unsplittable", cls))
    root = path[0]
    warnings.warn(
        f"Step argument {_format_path(path)} is a {_type_name(cls)}, which cannot be split into "
        "microbatches, so every microbatch receives the same object. If it holds per-sample data, pass it "
        "as a torch.Tensor or give its class a smp_slice(num_mb, mb, axis) method; if it is meant to be "
        f"shared, list {root!r} in non_split_inputs to silence this warning (shown once per type).",
        stacklevel=4,
    )


def _format_path(path: Path) -> str:
    text = str(path[0])
    for code, key in path[1:]:
        if code == "i":
            text += f"[{key}]"
        elif code == "a":
            text += f".{key}"
        elif code == "s":
            text += " (a set element)"
        else:
            text += f'["{key}"]' if isinstance(key, str) else f"[{key!r}]"
    return f"`{text}`"


def _type_name(cls: type) -> str:
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
