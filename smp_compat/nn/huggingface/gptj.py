"""Hugging Face GPT-J: ``GPTJModel`` swapped for tensor-parallel ``seq_layers``, and state-dict translation.

A GPT-J block is ``h + attn(ln_1(h)) + mlp(ln_1(h))``: one LayerNorm feeding two parallel branches, rotary
embeddings on the first ``rotary_dim`` features of each head (pairs interleaved), no bias on q/k/v nor on
``out_proj``, scores in fp32. ``seq_layers[i]`` holds that LayerNorm as ``layernorm`` and the branches as
``attention`` / ``output`` (see ``rotary_blocks.py``). ``wte``/``drop``/``ln_f`` are HF's own modules, so a tied
``lm_head`` stays tied and HF's loss runs unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smp_compat.nn.huggingface.gpt2 import _translate, add_causal_mask_buffers
from smp_compat.nn.huggingface.rotary_blocks import (
    RotaryEmbedding, additive_mask, build_layers, layer_options)  # fmt: skip
from smp_compat.nn.huggingface.inputs import refuse_unsupported_inputs
from smp_compat.nn.huggingface.building import activation_of, build_on_device, check_overrides
from smp_compat.nn.module import DistributedModule, shard
from smp_compat.nn.registry import register_builtin

__all__ = ["DistributedGPTJModel", "register", "translate_state_dict_to_hf_gptj",
           "translate_hf_gptj_state_dict_to_smdistributed_gptj", "translate_hf_state_dict_to_smdistributed_gptj",
           "translate_hf_gptj_state_dict_to_smdistributed"]  # fmt: skip

_NAMES = [
    ("ln_1.weight", "layernorm.weight"), ("ln_1.bias", "layernorm.bias"),
    ("attn.q_proj.weight", "attention.query_weight"), ("attn.k_proj.weight", "attention.key_weight"),
    ("attn.v_proj.weight", "attention.value_weight"), ("attn.out_proj.weight", "attention.dense_weight"),
    ("mlp.fc_in.weight", "output.dense1_weight"), ("mlp.fc_in.bias", "output.dense1_bias"),
    ("mlp.fc_out.weight", "output.dense2_weight"), ("mlp.fc_out.bias", "output.dense2_bias"),
]  # fmt: skip
"""(HF name, our name) within one block; nn.Linear weights keep their layout."""


def _layer_kwargs(config: Any) -> dict[str, Any]:
    """Layer arguments equal to a GPTJConfig; ValueError (the model stays unswapped) for what the swap lacks."""
    hidden, heads = config.n_embd, config.n_head
    if config.rotary_dim is None or config.rotary_dim > hidden // heads:
        raise ValueError(f"rotary_dim {config.rotary_dim!r} (the swap needs 0 < rotary_dim <= the head size)")
    return dict(
        num_attention_heads=heads, attention_head_size=hidden // heads, hidden_size=hidden,
        intermediate_size=config.n_inner or 4 * hidden, attention_dropout_prob=config.attn_pdrop,
        hidden_dropout_prob=config.resid_pdrop, activation=activation_of(config, "activation_function"),
        layernorm_epsilon=config.layer_norm_epsilon, initializer_range=config.initializer_range,
        use_normal_initialization=True, attention_bias=False, attention_in_fp32=True,
    )  # fmt: skip


class DistributedGPTJModel(DistributedModule):
    """``GPTJModel`` with its blocks as tensor-parallel ``seq_layers``; same forward signature and output type."""

    def __init__(self, hf: nn.Module, overrides: dict[str, Any] | None = None) -> None:
        super().__init__()
        config = hf.config
        self.config, self.embed_dim, self.num_layers = config, config.n_embd, config.n_layer
        rotary = RotaryEmbedding(config.rotary_dim, 10000.0, interleaved=True)
        layer = layer_options(_layer_kwargs(config), overrides or {})
        self.seq_layers = build_layers(config.n_layer, layer, rotary, parallel=True, shared_layernorm=True,
                                       dense_bias=False)  # fmt: skip
        self.wte, self.drop, self.ln_f = hf.wte, hf.drop, hf.ln_f
        if not any(p.is_meta for p in hf.parameters()):
            with torch.no_grad():
                for block, ours in zip(hf.h, self.seq_layers):
                    _copy_block(block.state_dict(), dict(ours.named_parameters()), _NAMES)

    def get_input_embeddings(self) -> nn.Module:
        return self.wte

    def set_input_embeddings(self, new: nn.Module) -> None:
        self.wte = new

    def forward(self, input_ids: torch.Tensor | None = None, past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutputWithPast

        refuse_unsupported_inputs("GPT-J", dict(kwargs, past_key_values=past_key_values, use_cache=use_cache,
                                  output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                                  attention_mask=attention_mask, position_ids=position_ids), packed_positions=True)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        h = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        s = h.shape[1]
        if position_ids is None:
            position_ids = torch.arange(s, device=h.device).unsqueeze(0)
        if token_type_ids is not None:
            h = h + self.wte(token_type_ids.view(-1, s))
        h = self.drop(h)
        h = self.seq_layers((h, additive_mask(attention_mask, h), position_ids))[0]
        return BaseModelOutputWithPast(last_hidden_state=self.ln_f(h))


def _copy_block(
    theirs: Mapping[str, torch.Tensor], ours: dict[str, nn.Parameter], names: list[tuple[str, str]]
) -> None:
    """Whole HF tensors into this rank's shards (or replicas) of one layer."""
    for hf_name, name in names:
        p = ours[name]
        p.copy_(shard(theirs[hf_name], p._smp_tp_dim) if hasattr(p, "_smp_tp_dim") else theirs[hf_name])


def translate_hf_gptj_state_dict_to_smdistributed_gptj(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A full HF GPT-J state dict -> the full state dict of the swapped model (``model.load_state_dict`` input)."""
    return _translate(state_dict, "h.", "seq_layers.", lambda sd: {ours: sd[hf] for hf, ours in _NAMES})


translate_hf_state_dict_to_smdistributed_gptj = translate_hf_gptj_state_dict_to_smdistributed_gptj
translate_hf_gptj_state_dict_to_smdistributed = translate_hf_gptj_state_dict_to_smdistributed_gptj
"""The other two names AWS's GPT-J examples import for the same function."""


def translate_state_dict_to_hf_gptj(
    state_dict: Mapping[str, Any], max_seq_len: int | None = None
) -> OrderedDict[str, Any]:
    """The swapped model's full state dict -> stock HF GPT-J names. ``max_seq_len`` adds the causal-mask buffers
    (``attn.bias``, ``attn.masked_bias``) that Hugging Face's GPT-J kept before 4.27 (SMP 1.8 ran on 4.17)."""
    out = _translate(state_dict, "seq_layers.", "h.", lambda sd: {hf: sd[ours] for hf, ours in _NAMES})
    if max_seq_len is not None:
        add_causal_mask_buffers(out, ".attn.q_proj.weight", max_seq_len, -1e9)
    return out


def _build(module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    check_overrides("GPT-J", overrides)
    return build_on_device(DistributedGPTJModel, module, overrides, _layer_kwargs(module.config))


def register() -> None:
    """Make ``GPTJModel`` (inside ``GPTJForCausalLM`` etc.) a supported module."""
    from transformers.models.gptj.modeling_gptj import GPTJModel

    register_builtin(GPTJModel, _build)
