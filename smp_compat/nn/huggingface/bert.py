"""Hugging Face BERT (and RoBERTa, same layout): the encoder swapped for a post-LayerNorm ``DistributedTransformer``.

``BertEncoder.layer[i]`` becomes ``encoder.seq_layers[i]`` with children ``attention`` (q/k/v column-parallel
by whole heads, ``attention.output.dense`` row-parallel, post-LN) and ``output`` (``intermediate.dense``
column-parallel, ``output.dense`` row-parallel, post-LN). Embeddings and pooler stay as they are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smp_compat.nn.huggingface.gpt2 import _translate
from smp_compat.nn.huggingface.inputs import refuse_unsupported_inputs
from smp_compat.nn.huggingface.building import activation_of, build_on_device
from smp_compat.nn.module import shard
from smp_compat.nn.registry import register_builtin
from smp_compat.nn.transformer import DistributedTransformer

__all__ = ["DistributedBertEncoder", "register", "translate_hf_state_dict_to_smdistributed_bert",
           "translate_state_dict_to_hf_bert", "translate_state_dict_to_smdistributed"]  # fmt: skip

# (HF name, our name) for one layer; nn.Linear weights keep their layout
_NAMES = [
    ("attention.self.query.weight", "attention.query_weight"), ("attention.self.query.bias", "attention.query_bias"),
    ("attention.self.key.weight", "attention.key_weight"), ("attention.self.key.bias", "attention.key_bias"),
    ("attention.self.value.weight", "attention.value_weight"), ("attention.self.value.bias", "attention.value_bias"),
    ("attention.output.dense.weight", "attention.dense_weight"), ("attention.output.dense.bias", "attention.dense_bias"),
    ("attention.output.LayerNorm.weight", "attention.layernorm.weight"),
    ("attention.output.LayerNorm.bias", "attention.layernorm.bias"),
    ("intermediate.dense.weight", "output.dense1_weight"), ("intermediate.dense.bias", "output.dense1_bias"),
    ("output.dense.weight", "output.dense2_weight"), ("output.dense.bias", "output.dense2_bias"),
    ("output.LayerNorm.weight", "output.layernorm.weight"), ("output.LayerNorm.bias", "output.layernorm.bias"),
]  # fmt: skip


def _layer_kwargs(config: Any) -> dict[str, Any]:
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("BERT as a decoder or with cross-attention is not supported by the tensor-parallel swap")
    hidden, heads = config.hidden_size, config.num_attention_heads
    return dict(
        num_layers=config.num_hidden_layers, num_attention_heads=heads, attention_head_size=hidden // heads,
        hidden_size=hidden, intermediate_size=config.intermediate_size,
        attention_dropout_prob=config.attention_probs_dropout_prob, hidden_dropout_prob=config.hidden_dropout_prob,
        activation=activation_of(config, "hidden_act"), layernorm_epsilon=config.layer_norm_eps,
        initializer_range=config.initializer_range, use_normal_initialization=True,
        pre_layernorm=False, post_layernorm=True,
    )  # fmt: skip


class DistributedBertEncoder(DistributedTransformer):
    """``BertEncoder`` / ``RobertaEncoder`` with tensor-parallel ``seq_layers``; same forward and output type."""

    def __init__(self, hf: nn.Module, overrides: dict[str, Any] | None = None) -> None:
        super().__init__(**{**_layer_kwargs(hf.config), **(overrides or {})})
        self.config = hf.config
        if not any(p.is_meta for p in hf.parameters()):
            with torch.no_grad():
                for block, layer in zip(hf.layer, self.seq_layers):
                    theirs = block.state_dict()
                    ours = dict(layer.named_parameters())
                    for hf_name, name in _NAMES:
                        p = ours[name]
                        p.copy_(shard(theirs[hf_name], p._smp_tp_dim) if hasattr(p, "_smp_tp_dim") else theirs[hf_name])

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool | None = None, **kwargs: Any) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        refuse_unsupported_inputs("BERT encoder", dict(kwargs, past_key_values=past_key_values, use_cache=use_cache,
                                  encoder_hidden_states=encoder_hidden_states))  # fmt: skip
        mask = attention_mask
        if mask is not None and mask.dtype == torch.bool:  # HF's 4-D mask: True = attend
            zeros = torch.zeros(mask.shape, dtype=hidden_states.dtype, device=mask.device)
            mask = zeros.masked_fill(~mask, torch.finfo(hidden_states.dtype).min)
        h = self.seq_layers((hidden_states, mask))[0]
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=h)


def translate_hf_state_dict_to_smdistributed_bert(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A full HF BERT/RoBERTa state dict -> the full state dict of the swapped model."""
    return _translate(state_dict, "encoder.layer.", "encoder.seq_layers.",
                      lambda sd: {ours: sd[hf] for hf, ours in _NAMES})  # fmt: skip


def translate_state_dict_to_hf_bert(state_dict: Mapping[str, Any], max_seq_len: int | None = None) -> OrderedDict[str, Any]:
    """The swapped model's full state dict -> stock HF names (``max_seq_len`` accepted: BERT has no mask buffers)."""
    return _translate(state_dict, "encoder.seq_layers.", "encoder.layer.",
                      lambda sd: {hf: sd[ours] for hf, ours in _NAMES})  # fmt: skip


translate_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_bert
"""The bare name AWS's RoBERTa example imports."""


def _build(module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    return build_on_device(DistributedBertEncoder, module, overrides, _layer_kwargs(module.config))


def register() -> None:
    """Make ``BertEncoder`` and ``RobertaEncoder`` supported modules."""
    from transformers.models.bert.modeling_bert import BertEncoder
    from transformers.models.roberta.modeling_roberta import RobertaEncoder

    register_builtin(BertEncoder, _build)
    register_builtin(RobertaEncoder, _build)
