"""Split a supported model's decoder layers over the tp group with DTensor (``parallelize_module``).

Column-wise projections (q, k, v or GPT-NeoX's fused qkv; gate, up) keep whole heads per rank and return local
tensors, so attention runs on the rank's own heads; row-wise projections (o, down) take the local features and
all-reduce their output. Everything else (embeddings, norms, rotary tables, the head) stays whole on every rank.
The attention and MLP blocks take their input as one replicated DTensor, so the gradients of its column-wise
consumers add up locally and meet in one all-reduce per block (Megatron's count) instead of one per projection.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.v2.transform.family import Family, HeadCounts

__all__ = ["check_divisible", "split_parameter_names", "split_layers"]


def check_divisible(family: Family, config: Any, tp: int) -> HeadCounts:
    """The model's head counts, after checking that tp splits heads, kv heads and the MLP width evenly."""
    counts = family.heads(config)
    sizes = {
        "num_attention_heads": counts.heads,
        "num_key_value_heads": counts.kv_heads,
        "intermediate_size": family.intermediate(config),
    }
    for key, size in sizes.items():
        if size % tp:
            raise SMPConfigError(
                f"torch.sagemaker.transform: {family.name}'s {key} ({size}) is not divisible by "
                f"tensor_parallel_degree ({tp}); each tp rank must hold whole heads and an equal MLP share. "
                f"Choose a tensor_parallel_degree that divides {size}."
            )
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        raise SMPUnsupportedError(
            f"torch.sagemaker.transform: Llama's pretraining_tp={config.pretraining_tp} (sliced projections) is not "
            "supported with tensor parallelism; set config.pretraining_tp = 1 (same model, one matmul per projection)."
        )
    return counts


def split_parameter_names(model: nn.Module, family: Family) -> set[str]:
    """Full names of the parameters ``split_layers`` distributes (every parameter of the planned projections)."""
    names: set[str] = set()
    prefix = _layers_prefix(model, family)
    for index, layer in enumerate(family.layers(model)):
        for path in family.colwise + family.rowwise:
            for name, _ in layer.get_submodule(path).named_parameters():
                names.add(f"{prefix}{index}.{path}.{name}")
    return names


def split_layers(model: nn.Module, family: Family, mesh: DeviceMesh, counts: HeadCounts) -> None:
    """Distribute each decoder layer's projections over ``mesh`` and give its attention the local head counts."""
    tp = mesh.size()
    plan = {path: ColwiseParallel() for path in family.colwise}
    plan.update({path: RowwiseParallel() for path in family.rowwise})
    local = {
        "heads": counts.heads // tp,
        "kv_heads": counts.kv_heads // tp,
        "width": counts.heads // tp * counts.head_dim,
    }
    for layer in family.layers(model):
        parallelize_module(layer, mesh, plan)
        for path in family.blocks:
            hook = functools.partial(_replicated_input, mesh)
            layer.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True)
        attention = layer.get_submodule(family.attention)
        for attribute, kind in family.head_attributes.items():
            if attribute in attention.__dict__:  # transformers 4.x keeps them as plain attributes
                setattr(attention, attribute, local[kind])


def _replicated_input(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The block's hidden states (first positional argument, or ``hidden_states=``) as a replicated DTensor."""
    if args:
        return (_as_replicated(args[0], mesh), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": _as_replicated(kwargs["hidden_states"], mesh)}
    return args, kwargs


def _as_replicated(value: Any, mesh: DeviceMesh) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return value


def _layers_prefix(model: nn.Module, family: Family) -> str:
    """The decoder layers' name prefix in ``model.named_parameters()`` (``model.layers.`` for Llama's head model)."""
    layers = family.layers(model)
    for name, module in model.named_modules():
        if module is layers:
            return f"{name}." if name else ""
    raise SMPConfigError(f"torch.sagemaker.transform: {family.name}'s decoder layers are not inside the model")
