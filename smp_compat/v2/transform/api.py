"""``torch.sagemaker.transform``: tensor parallelism for a supported Hugging Face model, names kept.

SMP v2 swaps the model for its Transformer-Engine implementation and translates state-dict keys back on a full
save. smp_compat keeps the Hugging Face modules and splits their projections with DTensor over the tp slice of
``state.device_mesh`` (sharding.py), so a full state dict is a Hugging Face checkpoint as it stands; the decoder
layers become ``TransformerLayer`` instances for the scripts' FSDP wrap policy and activation checkpointing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from smp_compat.errors import SMPConfigError, SMPNotInitializedError, SMPUnsupportedError
from smp_compat.v2.state import state
from smp_compat.v2.tensor_parallel.transformer import is_marked, mark_transformer_layer
from smp_compat.v2.transform.family import find_family
from smp_compat.v2.transform.sharding import check_divisible, split_layers, split_parameter_names
from smp_compat.v2.transform.sync import agree_within_tp_group

__all__ = ["transform", "tensor_parallelize"]

CP_COMM_TYPES = ("p2p", "all_gather")


def transform(
    model: nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: str = "p2p",
) -> nn.Module:
    """Split ``model`` over ``tsm.state``'s tp group (after ``tsm.init()``) and return it, names kept.

    ``device``/``dtype`` move or cast the model first (meta parameters stay on meta). With
    ``load_state_dict_from_rank0`` rank 0's weights reach its tp peers here; the other data-parallel ranks get
    them from FSDP's ``sync_module_states``. Collective over each tp group.
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise SMPConfigError(
            f"torch.sagemaker.transform: cp_comm_type must be one of {CP_COMM_TYPES}; got {cp_comm_type!r}"
        )
    if config is not None:  # Mixtral with SMP's MoE layer and expert parallelism (smp_compat/v2/moe)
        from smp_compat.v2.moe.convert import transform_moe

        return transform_moe(model, config, device, dtype, load_state_dict_from_rank0, _move)
    tp, mesh = _tp_from_state()
    if state.context_parallel_degree > 1:
        from smp_compat.v2.context_parallel.apply import context_parallelize

        context_parallelize(model, state.cp_process_group, cp_comm_type)
    return tensor_parallelize(model, mesh if tp > 1 else None, device, dtype, load_state_dict_from_rank0)


def tensor_parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    load_state_dict_from_rank0: bool = False,
) -> nn.Module:
    """``transform``'s work on a given 1-D tp mesh (None: tp = 1, layers marked only)."""
    family = find_family(model)
    layers = family.layers(model)
    if all(is_marked(layer) for layer in layers):
        return model  # transformed already: splitting again would split the pieces
    counts = check_divisible(family, model.config, mesh.size() if mesh is not None else 1)
    _move(model, device, dtype)
    if mesh is not None:
        split = split_parameter_names(model, family)
        agree_within_tp_group(model, mesh, split, load_state_dict_from_rank0, _as_device(device))
        split_layers(model, family, mesh, counts)
    for layer in layers:
        mark_transformer_layer(layer)
    return model


def _as_device(device: torch.device | str | None) -> torch.device | None:
    return None if device is None else torch.device(device)


def _move(model: nn.Module, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
    """Honour ``device`` and ``dtype``: floating tensors cast, real tensors moved, meta ones left on meta."""
    if dtype is not None:
        if not dtype.is_floating_point:
            raise SMPConfigError(f"torch.sagemaker.transform: dtype must be a floating-point dtype; got {dtype}")
        model.to(dtype=dtype)
    if device is not None and not any(t.is_meta for t in model.parameters()):
        model.to(device=_as_device(device))


def _tp_from_state() -> tuple[int, DeviceMesh | None]:
    """(tensor_parallel_degree, the tp mesh) from ``tsm.state``; errors for init missing or ep."""
    if not state.initialized:
        raise SMPNotInitializedError("torch.sagemaker.transform needs torch.sagemaker.init() first.")
    ep = state.expert_parallel_degree
    if ep > 1:
        raise SMPUnsupportedError(
            f"torch.sagemaker.transform: expert parallelism (expert_parallel_degree={ep}) works through "
            "transform(model, config=MoEConfig(...)) for Mixtral; without config=MoEConfig(...) set "
            "expert_parallel_degree to 1 (Mixtral then runs with its experts whole on every rank)."
        )
    tp = state.tensor_parallel_degree
    return tp, (state.device_mesh["tp"] if tp > 1 else None)
