"""GPT-NeoX: the fused ``query_key_value`` projection is laid out head by head (head 0's q|k|v, then head 1's...),
so an even split of its output features gives each rank whole heads with their own q, k and v, exactly; the
MLP's dense_h_to_4h splits by output features, dense and dense_4h_to_h by input features."""

from __future__ import annotations

from typing import Any

from torch import nn

from smp_compat.v2.transform.family import Family, HeadCounts, base_model

__all__ = ["FAMILY"]


def _layers(model: nn.Module) -> nn.ModuleList:
    return base_model(model, "gpt_neox").layers


def _heads(config: Any) -> HeadCounts:
    heads = config.num_attention_heads
    return HeadCounts(heads, heads, config.hidden_size // heads)


FAMILY = Family(
    name="GPT-NeoX",
    model_types=("gpt_neox",),
    layers=_layers,
    heads=_heads,
    intermediate=lambda config: config.intermediate_size,
    attention="attention",
    blocks=("attention", "mlp"),
    colwise=("attention.query_key_value", "mlp.dense_h_to_4h"),
    rowwise=("attention.dense", "mlp.dense_4h_to_h"),
    head_attributes={"num_attention_heads": "heads", "hidden_size": "width"},
)
