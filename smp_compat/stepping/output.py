"""StepOutput, the per-microbatch results of an ``@smp.step`` call, and the containers both sides share."""

from __future__ import annotations

import collections.abc
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from smp_compat.errors import StepUsageError

__all__ = ["StepOutput", "merge_step_outputs"]

# Container kinds, shared with ``smp_compat.stepping.split`` so that inputs and outputs walk the same structures.
LIST, TUPLE, NAMEDTUPLE, MAPPING, SET = range(5)

_CONTAINER_KIND: dict[type, int | None] = {}
_LEAF_TUPLES: tuple[type, ...] = (torch.Size,)
_warned_rebuild: set[type] = set()


class StepOutput:
    """Per-microbatch values of one tensor returned by an ``@smp.step`` function.

    ``outputs[i]`` is microbatch ``i``'s value. Scripts mostly call ``reduce_mean()`` on the loss and
    ``concat()`` on logits; both follow SMP exactly (``concat`` always joins on dim 0).
    """

    def __init__(self, outputs: list[Any]) -> None:
        # A copy, so that a list the caller keeps appending to cannot change this result afterwards.
        self.outputs: list[Any] = list(outputs)

    def __getitem__(self, index: int) -> Any:
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def reduce_sum(self) -> torch.Tensor:
        """Sum of the per-microbatch values (kept as a left fold so that broadcasting works as ``sum``)."""
        self._require_values("reduce_sum")
        total = self.outputs[0]
        for value in self.outputs[1:]:
            total = total + value
        return total

    def reduce_mean(self) -> torch.Tensor:
        """``sum(outputs) / len(outputs)``: the loss over the whole batch when microbatches are equal."""
        return self.reduce_sum() / len(self.outputs)

    def concat(self) -> torch.Tensor:
        """``torch.cat(outputs, dim=0)``; dim 0 even when the inputs were split on another axis, as in SMP."""
        self._require_values("concat")
        if any(isinstance(v, torch.Tensor) and v.dim() == 0 for v in self.outputs):
            raise StepUsageError(
                "StepOutput.concat() joins per-microbatch tensors along dim 0, but these values are 0-dim "
                f"(scalars): {self!r}. Use reduce_mean(), reduce_sum() or stack() for scalar outputs."
            )
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        """``torch.stack(outputs)``: a new leading microbatch dimension."""
        self._require_values("stack")
        return torch.stack(self.outputs)

    def map(self, fn: Callable[[Any], Any]) -> StepOutput:
        """Apply ``fn`` to each microbatch value, e.g. ``so.map(lambda t: t.cpu())``."""
        return StepOutput([fn(value) for value in self.outputs])

    def detach(self) -> StepOutput:
        """Each microbatch value detached from the graph (SMP >= 1.10; Hugging Face's ``smp_nested_concat`` calls
        ``step_output.detach().concat()`` on evaluation logits)."""
        return self.map(lambda value: value.detach() if isinstance(value, torch.Tensor) else value)

    def clear(self) -> None:
        """Drop the values, so that a long-lived StepOutput does not keep tensors alive."""
        self.outputs = []

    def __repr__(self) -> str:
        descriptions = [_describe_value(v) for v in self.outputs]
        if descriptions and all(d == descriptions[0] for d in descriptions):
            body = f"{descriptions[0]} x {len(descriptions)}"
        else:
            body = ", ".join(descriptions)
        return f"StepOutput(num_microbatches={len(self.outputs)}, [{body}])"

    def _require_values(self, method: str) -> None:
        if not self.outputs:
            raise StepUsageError(
                f"StepOutput.{method}() was called on a StepOutput with no values (0 microbatches). "
                "It was probably emptied by clear(); call the reduction before clearing it."
            )


def merge_step_outputs(per_microbatch: list[Any]) -> Any:
    """Rebuild the structure the step function returned, with per-microbatch values at the leaves.

    Containers (list, tuple, namedtuple, dict and dict subclasses, other mutable mappings) keep their type.
    A leaf that is a tensor in every microbatch becomes a ``StepOutput``; any other leaf (None included)
    becomes a plain list with one entry per microbatch, as in SMP's code. A function that returns None in
    every microbatch gives None. All microbatches must return the same containers, lengths and keys.
    """
    if not per_microbatch:
        raise StepUsageError(
            "merge_step_outputs() got no microbatch results (an empty list). A step call runs at least one "
            "microbatch; check that the configured 'microbatches' is at least 1."
        )
    if all(value is None for value in per_microbatch):
        return None
    return _merge(list(per_microbatch), "return value", per_microbatch)


def container_kind(cls: type) -> int | None:
    """The container kind of ``cls`` (LIST, TUPLE, ...), or None for a leaf; cached per type."""
    try:
        return _CONTAINER_KIND[cls]
    except KeyError:
        kind = _compute_container_kind(cls)
        _CONTAINER_KIND[cls] = kind
        return kind


def _compute_container_kind(cls: type) -> int | None:
    if issubclass(cls, (torch.Tensor, StepOutput)) or issubclass(cls, _LEAF_TUPLES):
        return None
    if issubclass(cls, tuple):
        return NAMEDTUPLE if hasattr(cls, "_fields") else TUPLE
    if issubclass(cls, list):
        return LIST
    if issubclass(cls, (dict, collections.abc.MutableMapping)):
        return MAPPING
    if issubclass(cls, (set, frozenset)):
        return SET
    return None


def rebuild_sequence(template: Any, kind: int, items: list[Any]) -> Any:
    """A list or tuple of the same type as ``template`` holding ``items``."""
    cls = type(template)
    if cls is tuple:
        return tuple(items)
    if cls is list:
        return items
    if kind == NAMEDTUPLE:
        return cls._make(items)
    try:
        if kind == LIST:
            new = copy.copy(template)
            new[:] = items
            return new
        return cls(items)
    except Exception:  # noqa: BLE001 - any failure of a user type's constructor: fall back, and say so
        _warn_type_lost(cls, "list" if kind == LIST else "tuple")
        return list(items) if kind == LIST else tuple(items)


def rebuild_mapping(template: Any, updates: list[tuple[Any, Any]]) -> Any:
    """A shallow copy of ``template`` (type, attributes, ``default_factory`` kept) with ``updates`` set."""
    if type(template) is dict:
        new = dict(template)
    else:
        try:
            new = copy.copy(template)
        except Exception:  # noqa: BLE001 - a user type that cannot be copied: fall back, and say so
            _warn_type_lost(type(template), "dict")
            new = dict(template)
    for key, value in updates:
        new[key] = value
    return new


def rebuild_set(template: Any, items: list[Any]) -> Any:
    """A set of the same type as ``template`` holding ``items``."""
    try:
        return type(template)(items)
    except Exception:  # noqa: BLE001 - a user set type with an unusual constructor
        _warn_type_lost(type(template), "set")
        return set(items)


def _warn_type_lost(cls: type, fallback: str) -> None:
    if cls not in _warned_rebuild:
        _warned_rebuild.add(cls)
        warnings.warn(
            f"smp_compat could not rebuild a {cls.__module__}.{cls.__qualname__} per microbatch and used a "
            f"plain {fallback} instead. Give the type a constructor that accepts the items, or pass plain "
            "containers to and from the step function.",
            stacklevel=3,
        )


def _merge(values: list[Any], path: str, tops: list[Any]) -> Any:
    head = values[0]
    kind = container_kind(type(head))
    for mb, value in enumerate(values[1:], start=1):
        if kind is None:
            mismatch = container_kind(type(value)) is not None
        else:
            mismatch = type(value) is not type(head)
        if mismatch:
            _raise_mismatch(mb, path, tops)
    if kind is None:
        if all(isinstance(value, torch.Tensor) for value in values):
            return StepOutput(values)
        return list(values)
    if kind == MAPPING:
        return _merge_mapping(values, path, tops)
    if kind == SET:
        # Set elements have no position to match across microbatches: the whole set is one leaf.
        return list(values)
    return _merge_sequence(values, kind, path, tops)


def _merge_sequence(values: list[Any], kind: int, path: str, tops: list[Any]) -> Any:
    head = values[0]
    for mb, value in enumerate(values[1:], start=1):
        if len(value) != len(head):
            _raise_mismatch(mb, path, tops)
    fields = getattr(head, "_fields", None) if kind == NAMEDTUPLE else None
    items = [
        _merge([value[i] for value in values], f"{path}.{fields[i]}" if fields else f"{path}[{i}]", tops)
        for i in range(len(head))
    ]
    return rebuild_sequence(head, kind, items)


def _merge_mapping(values: list[Any], path: str, tops: list[Any]) -> Any:
    head = values[0]
    keys = list(head.keys())
    key_set = set(keys)
    for mb, value in enumerate(values[1:], start=1):
        if len(value) != len(keys) or set(value.keys()) != key_set:
            _raise_mismatch(mb, path, tops)
    updates = [(key, _merge([value[key] for value in values], f"{path}[{key!r}]", tops)) for key in keys]
    return rebuild_mapping(head, updates)


def _raise_mismatch(mb: int, path: str, tops: list[Any]) -> None:
    raise StepUsageError(
        f"Microbatch {mb} of the step function returned a different structure from microbatch 0 "
        f"(first difference at {path}). Microbatch 0 returned {_describe_structure(tops[0])}; microbatch "
        f"{mb} returned {_describe_structure(tops[mb])}. Every microbatch must return the same containers "
        "with the same lengths and keys; return per-sample data as a tensor rather than as a list whose "
        "length depends on the batch."
    )


def _describe_structure(value: Any, limit: int = 300) -> str:
    text = _structure(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _structure(value: Any) -> str:
    kind = container_kind(type(value))
    name = type(value).__name__
    if kind in (LIST, TUPLE, NAMEDTUPLE):
        inner = ", ".join(_structure(v) for v in value)
        return f"[{inner}]" if type(value) is list else f"{name}({inner})"
    if kind == MAPPING:
        inner = ", ".join(f"{k!r}: {_structure(v)}" for k, v in value.items())
        return f"{{{inner}}}" if type(value) is dict else f"{name}{{{inner}}}"
    if isinstance(value, torch.Tensor):
        return "Tensor"
    return name


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"Tensor{tuple(value.shape)} {dtype}"
    return type(value).__name__
