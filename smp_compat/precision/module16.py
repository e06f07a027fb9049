"""SMP's 16-bit module (``fp16`` / ``bf16`` config keys): the model's own weights in 16 bits, fp32 at its edges."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from smp_compat.errors import SMPConfigError
from smp_compat.globalstate import state

__all__ = ["sixteen_bit_dtype", "check_built_in_16_bit", "to_16bit", "to_float32"]


def sixteen_bit_dtype() -> torch.dtype:
    """The dtype the config's ``fp16`` or ``bf16`` asks for."""
    return torch.float16 if state.cfg.fp16 else torch.bfloat16


def check_built_in_16_bit(module: nn.Module) -> None:
    """fp16/bf16 (without sharded data parallelism) train the model's own 16-bit weights. A model built in fp32
    failed at its first layer with a dtype mismatch deep in torch, or, fed integer ids, silently trained in fp32."""
    floating = [p.dtype for p in module.parameters() if p.is_floating_point()]
    if floating and all(dtype == torch.float32 for dtype in floating):
        name = "fp16" if state.cfg.fp16 else "bf16"
        dtype = str(sixteen_bit_dtype()).removeprefix("torch.")
        raise SMPConfigError(
            f"{name} is on but every parameter of the model is float32. As in SMP, build the model inside "
            f"`with smp.model_creation(dtype=torch.{dtype}):` (or convert it with .to(torch.{dtype})) before "
            "smp.DistributedModel; DistributedOptimizer then keeps fp32 master weights."
        )


def to_16bit(value: Any) -> Any:
    """Floating inputs are cast to the model's 16-bit dtype..."""
    dtype = sixteen_bit_dtype()
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def to_float32(value: Any) -> Any:
    """...and floating outputs back to fp32, so losses are computed in fp32."""
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)
