"""What every Hugging Face swap does at ``DistributedModel``: refuse options it cannot honour, then build the
distributed replacement on the original's device with the layer options it understands."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.nn.module import KERNEL_FLAGS

__all__ = ["activation_of", "build_on_device", "check_overrides"]

_MODEL_LEVEL_FLAGS = {"distribute_embedding", "zero_init", "layer_idx"}
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def activation_of(config: Any, field: str) -> str:
    """smp.nn's name for the activation in ``config.<field>``; ValueError, so the model stays unswapped, for
    one the swap does not have (or a callable)."""
    name = getattr(config, field)
    if not isinstance(name, str) or name not in _ACTIVATIONS:
        raise ValueError(f"{field} {name!r} is not supported by the tensor-parallel swap")
    return _ACTIVATIONS[name]


def check_overrides(model: str, overrides: dict[str, Any]) -> None:
    """``tensor_parallelism(...)`` options the swap cannot honour, set away from their defaults, are refused."""
    ignored = {"use_alibi": False, "distribute_embedding": False, "zero_init": False}
    bad = {k: v for k, v in overrides.items() if k in ignored and v != ignored[k]}
    if bad:
        raise SMPUnsupportedError(f"{model} tensor-parallel options {bad}")


def build_on_device(cls: type[nn.Module], module: nn.Module, overrides: dict[str, Any], layer_args: Iterable[str]) -> nn.Module:
    """``cls(module, options)`` on ``module``'s device; ``options``: the overrides that are layer arguments or
    kernel flags (the others are the model's business, checked by ``check_overrides``)."""
    known = set(layer_args) | (KERNEL_FLAGS - _MODEL_LEVEL_FLAGS)
    with torch.device(next(module.parameters()).device):
        return cls(module, {k: v for k, v in overrides.items() if k in known})
