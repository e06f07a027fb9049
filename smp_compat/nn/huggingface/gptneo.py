"""Hugging Face GPT-Neo: ``GPTNeoModel`` swapped for a ``DistributedTransformer`` (as GPT-2, see ``gpt2.py``).

GPT-Neo differs from GPT-2 in ways the layer options cover: q/k/v without bias (``attention_bias=False``),
unscaled scores computed in fp32, and sliding-window causal attention on its "local" layers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smp_compat.nn.huggingface.gpt2 import _translate, embed_with_mask
from smp_compat.nn.huggingface.inputs import refuse_unsupported_inputs
from smp_compat.nn.huggingface.building import activation_of, build_on_device
from smp_compat.nn.module import shard
from smp_compat.nn.registry import register_builtin
from smp_compat.nn.transformer import DistributedTransformer

__all__ = ["DistributedGPTNeoModel", "register", "translate_hf_state_dict_to_smdistributed_gptneo",
           "translate_state_dict_to_hf_gptneo"]  # fmt: skip

_NAMES = [
    ("ln_1.weight", "attention.layernorm.weight"), ("ln_1.bias", "attention.layernorm.bias"),
    ("attn.attention.q_proj.weight", "attention.query_weight"), ("attn.attention.k_proj.weight", "attention.key_weight"),
    ("attn.attention.v_proj.weight", "attention.value_weight"),
    ("attn.attention.out_proj.weight", "attention.dense_weight"), ("attn.attention.out_proj.bias", "attention.dense_bias"),
    ("ln_2.weight", "output.layernorm.weight"), ("ln_2.bias", "output.layernorm.bias"),
    ("mlp.c_fc.weight", "output.dense1_weight"), ("mlp.c_fc.bias", "output.dense1_bias"),
    ("mlp.c_proj.weight", "output.dense2_weight"), ("mlp.c_proj.bias", "output.dense2_bias"),
]  # fmt: skip


def _layer_kwargs(config: Any) -> dict[str, Any]:
    hidden, heads = config.hidden_size, config.num_heads
    return dict(
        num_layers=config.num_layers, num_attention_heads=heads, attention_head_size=hidden // heads,
        hidden_size=hidden, intermediate_size=config.intermediate_size or 4 * hidden,
        attention_dropout_prob=config.attention_dropout, hidden_dropout_prob=config.resid_dropout,
        activation=activation_of(config, "activation_function"), layernorm_epsilon=config.layer_norm_epsilon,
        initializer_range=config.initializer_range, use_normal_initialization=True,
        causal_mask_size=config.max_position_embeddings, pre_layernorm=True, post_layernorm=False,
        scale_attention_scores=False, attention_in_fp32=True, attention_bias=False,
    )  # fmt: skip


class DistributedGPTNeoModel(DistributedTransformer):
    """``GPTNeoModel`` with tensor-parallel ``seq_layers``; same forward signature and output type."""

    def __init__(self, hf: nn.Module, overrides: dict[str, Any] | None = None) -> None:
        super().__init__(**{**_layer_kwargs(hf.config), **(overrides or {})})
        self.config = hf.config
        self.wte, self.wpe, self.drop, self.ln_f = hf.wte, hf.wpe, hf.drop, hf.ln_f
        for kind, layer in zip(hf.config.attention_layers, self.seq_layers):
            layer.attention.math.window_size = hf.config.window_size if kind == "local" else None
        if not any(p.is_meta for p in hf.parameters()):
            with torch.no_grad():
                for block, layer in zip(hf.h, self.seq_layers):
                    theirs, ours = block.state_dict(), dict(layer.named_parameters())
                    for hf_name, name in _NAMES:
                        p = ours[name]
                        p.copy_(shard(theirs[hf_name], p._smp_tp_dim) if hasattr(p, "_smp_tp_dim") else theirs[hf_name])

    def get_input_embeddings(self) -> nn.Module:
        return self.wte

    def set_input_embeddings(self, new: nn.Module) -> None:
        self.wte = new

    def forward(self, input_ids: torch.Tensor | None = None, past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, **kwargs: Any) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutputWithPast

        refuse_unsupported_inputs("GPT-Neo", dict(kwargs, past_key_values=past_key_values, use_cache=use_cache,
                                  attention_mask=attention_mask, position_ids=position_ids), packed_positions=True)
        h, mask, shape = embed_with_mask(self, input_ids, inputs_embeds, position_ids, token_type_ids, attention_mask)
        h = self.ln_f(self.seq_layers((h, mask))[0]).view(*shape, h.shape[-1])
        return BaseModelOutputWithPast(last_hidden_state=h)


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A full HF GPT-Neo state dict -> the full state dict of the swapped model."""
    return _translate(state_dict, "h.", "seq_layers.", lambda sd: {ours: sd[hf] for hf, ours in _NAMES})


def translate_state_dict_to_hf_gptneo(
    state_dict: Mapping[str, Any], max_seq_len: int | None = None
) -> OrderedDict[str, Any]:
    """The swapped model's full state dict -> stock HF GPT-Neo names (its mask buffers are not persistent, so
    ``max_seq_len`` is accepted and unused)."""
    return _translate(state_dict, "seq_layers.", "h.", lambda sd: {hf: sd[ours] for hf, ours in _NAMES})


def _build(module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    return build_on_device(DistributedGPTNeoModel, module, overrides, _layer_kwargs(module.config))


def register() -> None:
    """Make ``GPTNeoModel`` (inside ``GPTNeoForCausalLM`` etc.) a supported module."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoModel

    register_builtin(GPTNeoModel, _build)
