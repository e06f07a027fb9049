"""Split a nested value into a picklable skeleton and its tensors, and put it back together."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.stepping.output import MAPPING, SET, container_kind, rebuild_mapping, rebuild_sequence, rebuild_set

__all__ = ["flatten_tensors", "fill_tensors", "Slot"]


@dataclass(frozen=True)
class Slot:
    """Where the i-th tensor goes back in the skeleton."""

    index: int


def flatten_tensors(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """The skeleton of ``value`` (containers kept, tensors replaced by ``Slot``s) and its tensors in order."""
    tensors: list[torch.Tensor] = []
    return _strip(value, tensors), tensors


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return Slot(len(tensors) - 1)
    kind = container_kind(type(value))
    if kind is None:
        if isinstance(value, nn.Module):
            _refuse_module(value)
        return _map_dataclass(value, lambda v: _strip(v, tensors)) if _is_dataclass(value) else value
    if kind == MAPPING:
        return rebuild_mapping(value, [(k, _strip(v, tensors)) for k, v in value.items()])
    if kind == SET:
        return rebuild_set(value, [_strip(v, tensors) for v in value])
    return rebuild_sequence(value, kind, [_strip(v, tensors) for v in value])


def _refuse_module(module: nn.Module) -> None:
    """A module crossing ranks would arrive as a copy, and the copy's parameters would train instead of its own."""
    if next(module.parameters(), None) is not None:
        raise SMPUnsupportedError(
            f"a {type(module).__name__} with parameters is passed to (or returned from) a module on another "
            "pipeline rank: it would arrive there as a copy whose parameters do not train. Call it where it is, or "
            "make it a child of the module that uses it."
        )


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of ``flatten_tensors``."""
    if isinstance(skeleton, Slot):
        return tensors[skeleton.index]
    kind = container_kind(type(skeleton))
    if kind is None:
        return _map_dataclass(skeleton, lambda v: fill_tensors(v, tensors)) if _is_dataclass(skeleton) else skeleton
    if kind == MAPPING:
        return rebuild_mapping(skeleton, [(k, fill_tensors(v, tensors)) for k, v in skeleton.items()])
    if kind == SET:
        return rebuild_set(skeleton, [fill_tensors(v, tensors) for v in skeleton])
    return rebuild_sequence(skeleton, kind, [fill_tensors(v, tensors) for v in skeleton])


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _map_dataclass(value: Any, fn: Callable[[Any], Any]) -> Any:
    """A shallow copy of a dataclass instance with ``fn`` applied to each field (frozen ones too)."""
    new = copy.copy(value)
    for f in dataclasses.fields(value):
        object.__setattr__(new, f.name, fn(getattr(value, f.name)))
    return new
