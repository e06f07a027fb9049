"""Llama 2 and 3 (3.1's llama3 rope scaling needs nothing of its own): q/k/v and gate/up split by output
features (whole heads per rank), o/down by input features."""

from __future__ import annotations

from typing import Any

from torch import nn

from smp_compat.v2.transform.family import Family, HeadCounts, base_model

__all__ = ["FAMILY", "decoder_heads", "decoder_layers"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return base_model(model, "model").layers


def decoder_heads(config: Any) -> HeadCounts:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return HeadCounts(heads, kv_heads, head_dim)


FAMILY = Family(
    name="Llama",
    model_types=("llama",),
    layers=decoder_layers,
    heads=decoder_heads,
    intermediate=lambda config: config.intermediate_size,
    attention="self_attn",
    blocks=("self_attn", "mlp"),
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    # transformers 4.x reshapes with these; 5.x infers the head count from the local tensor
    head_attributes={"num_heads": "heads", "num_key_value_heads": "kv_heads", "hidden_size": "width"},
)
