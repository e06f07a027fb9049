"""fp32 master shards for a model built in 16 bits under sharded data parallelism (``fp16`` / ``bf16``).

SMP's sharded optimizer (ZeRO-3 lineage) kept fp32 partitions as master weights and fp32 optimizer
state; the 16-bit parameters existed only for compute and communication. FSDP2 keeps each shard in the
dtype its parameter had at ``fully_shard``, and its ``MixedPrecisionPolicy`` only casts what it gathers
and reduces, so a model built under ``smp.model_creation(dtype=torch.bfloat16)`` would get bf16 shards,
gradients and Adam moments (updates below half an ulp rounded away; in fp16, moments that underflow).
Each unit's floating parameters are therefore upcast to fp32 just before it is sharded (exact: the
fp32 master starts equal to the 16-bit weight, as SMP's did); the policy gathers them back as 16 bits.

Full state dicts (``model.state_dict()``) give each parameter back in the dtype it was built in, as
SMP's full model was the 16-bit one; sharded (DCP) checkpoints keep the fp32 masters (docs/checkpoints.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from smp_compat.globalstate import state

__all__ = ["sixteen_bit_training", "built_dtypes", "upcast_parameters", "cast_to_built_dtypes"]


def sixteen_bit_training() -> bool:
    """The config asks for 16-bit compute (``fp16`` or ``bf16``): the shards are fp32 masters."""
    return bool(state.cfg.fp16 or state.cfg.bf16)


def built_dtypes(root: nn.Module) -> dict[str, torch.dtype]:
    """``{parameter name: dtype}`` of the floating parameters that are not fp32 (taken before sharding)."""
    return {
        name: p.dtype
        for name, p in root.named_parameters(remove_duplicate=False)
        if p.is_floating_point() and p.dtype != torch.float32
    }


def upcast_parameters(modules: Iterable[nn.Module]) -> None:
    """The modules' own floating parameters become fp32 in place (same objects: ties and marks are kept)."""
    seen: set[int] = set()
    for m in modules:
        for p in m._parameters.values():
            if p is None or id(p) in seen or not p.is_floating_point() or p.dtype == torch.float32:
                continue
            if p.is_meta or isinstance(p, DTensor):  # not materialized yet / already sharded by an earlier unit
                continue
            seen.add(id(p))
            p.data = p.data.float()  # as nn.Module.float() converts a parameter


def cast_to_built_dtypes(state_dict: dict[str, Any], dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """A full state dict with each parameter in the dtype the model was built in (SMP's 16-bit model)."""
    return {
        k: v.to(dtypes[k]) if k in dtypes and isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in state_dict.items()
    }
