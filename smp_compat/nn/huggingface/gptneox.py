"""Hugging Face GPT-NeoX: ``GPTNeoXModel`` swapped for tensor-parallel ``seq_layers``, and state-dict translation.

A GPT-NeoX layer has two LayerNorms (``input_layernorm`` -> ``attention.layernorm``, ``post_attention_layernorm``
-> ``output.layernorm``), a fused ``query_key_value`` laid out per head (``[heads, q|k|v, head_size]`` rows),
split here into q/k/v so whole heads go to each rank, rotary embeddings on the first
``partial_rotary_factor`` of each head ("rotate_half"), and either the parallel residual
``h + attn(ln1(h)) + mlp(ln2(h))`` or the sequential one (``use_parallel_residual``). ``embed_in``,
``emb_dropout`` and ``final_layer_norm`` are HF's own modules (a tied ``lm_head`` stays tied).

SMP v1 swapped GPT-NeoX (1.13 notes) but never documented the module's translate functions; the names here
follow the pattern of the documented ones (``gptneox.translate_state_dict_to_hf_gptneox``,
``gptneox.translate_hf_state_dict_to_smdistributed_gptneox``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smp_compat.nn.huggingface.gpt2 import _translate, add_causal_mask_buffers
from smp_compat.nn.huggingface.gptj import _copy_block
from smp_compat.nn.huggingface.rotary_blocks import (
    RotaryEmbedding, additive_mask, build_layers, layer_options)  # fmt: skip
from smp_compat.nn.huggingface.inputs import refuse_unsupported_inputs
from smp_compat.nn.huggingface.building import activation_of, build_on_device, check_overrides
from smp_compat.nn.module import DistributedModule
from smp_compat.nn.registry import register_builtin

__all__ = ["DistributedGPTNeoXModel", "register", "translate_state_dict_to_hf_gptneox",
           "translate_hf_state_dict_to_smdistributed_gptneox"]  # fmt: skip

_PLAIN = [
    ("input_layernorm.weight", "attention.layernorm.weight"), ("input_layernorm.bias", "attention.layernorm.bias"),
    ("attention.dense.weight", "attention.dense_weight"), ("attention.dense.bias", "attention.dense_bias"),
    ("post_attention_layernorm.weight", "output.layernorm.weight"),
    ("post_attention_layernorm.bias", "output.layernorm.bias"),
    ("mlp.dense_h_to_4h.weight", "output.dense1_weight"), ("mlp.dense_h_to_4h.bias", "output.dense1_bias"),
    ("mlp.dense_4h_to_h.weight", "output.dense2_weight"), ("mlp.dense_4h_to_h.bias", "output.dense2_bias"),
]  # fmt: skip
"""(HF name, our name) within one layer, besides the fused query_key_value."""
_QKV = ("query", "key", "value")


def _rotary(config: Any) -> RotaryEmbedding:
    """The config's rotary embedding, read under either spelling: transformers 5's ``rope_parameters`` dict, or
    4.x's attributes (``rotary_pct`` / ``partial_rotary_factor``, ``rotary_emb_base`` / ``rope_theta``,
    ``rope_scaling``)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} (the swap computes the default rotary embedding)")
    head = config.hidden_size // config.num_attention_heads
    if getattr(config, "head_dim", None) not in (None, head):
        raise ValueError(f"head_dim {config.head_dim} different from hidden_size / num_attention_heads")
    theta = rope.get("rope_theta", getattr(config, "rope_theta", getattr(config, "rotary_emb_base", 10000.0)))
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    factor = getattr(config, "rotary_pct", 1.0) if factor is None else factor
    return RotaryEmbedding(int(head * factor), theta, interleaved=False)


def _bias(config: Any) -> bool:
    """Whether the attention has biases (``attention_bias``; transformers 4.36 lacks the option and always has them)."""
    return bool(getattr(config, "attention_bias", True))


def _layer_kwargs(config: Any) -> dict[str, Any]:
    """Layer arguments equal to a GPTNeoXConfig; ValueError (the model stays unswapped) for what the swap lacks."""
    _rotary(config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    return dict(
        num_attention_heads=heads, attention_head_size=hidden // heads, hidden_size=hidden,
        intermediate_size=config.intermediate_size, attention_dropout_prob=config.attention_dropout,
        hidden_dropout_prob=config.hidden_dropout, activation=activation_of(config, "hidden_act"),
        layernorm_epsilon=config.layer_norm_eps, initializer_range=config.initializer_range,
        use_normal_initialization=True, attention_bias=_bias(config), attention_in_fp32=True,
    )  # fmt: skip


class DistributedGPTNeoXModel(DistributedModule):
    """``GPTNeoXModel`` with its layers as tensor-parallel ``seq_layers``; same forward signature and output type."""

    def __init__(self, hf: nn.Module, overrides: dict[str, Any] | None = None) -> None:
        super().__init__()
        config = hf.config
        self.config, self.num_layers = config, config.num_hidden_layers
        layer = layer_options(_layer_kwargs(config), overrides or {})
        _heads_seen.add(config.num_attention_heads)
        self.seq_layers = build_layers(config.num_hidden_layers, layer, _rotary(config),
                                       parallel=bool(config.use_parallel_residual), shared_layernorm=False,
                                       dense_bias=_bias(config))  # fmt: skip
        self.embed_in, self.emb_dropout, self.final_layer_norm = hf.embed_in, hf.emb_dropout, hf.final_layer_norm
        if not any(p.is_meta for p in hf.parameters()):
            with torch.no_grad():
                for block, ours in zip(hf.layers, self.seq_layers):
                    theirs = _hf_layer_to_smp(block.state_dict(), config.num_attention_heads)
                    _copy_block(theirs, dict(ours.named_parameters()), [(n, n) for n in theirs])

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_in

    def set_input_embeddings(self, new: nn.Module) -> None:
        self.embed_in = new

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool | None = None, **kwargs: Any) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutputWithPast

        refuse_unsupported_inputs("GPT-NeoX", dict(kwargs, past_key_values=past_key_values, use_cache=use_cache,
                                  attention_mask=attention_mask, position_ids=position_ids), packed_positions=True)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        h = self.embed_in(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        h = self.emb_dropout(h)
        h = self.seq_layers((h, additive_mask(attention_mask, h), position_ids))[0]
        return BaseModelOutputWithPast(last_hidden_state=self.final_layer_norm(h))


def _hf_layer_to_smp(sd: Mapping[str, torch.Tensor], heads: int) -> dict[str, Any]:
    """One layer, HF names -> ours; the fused per-head q|k|v rows become three whole tensors."""
    out = {ours: sd[hf] for hf, ours in _PLAIN if hf in sd}
    w = sd["attention.query_key_value.weight"]
    parts = w.view(heads, 3, -1, w.shape[-1]).unbind(1)
    out.update({f"attention.{n}_weight": p.reshape(-1, w.shape[-1]) for n, p in zip(_QKV, parts)})
    if "attention.query_key_value.bias" in sd:
        parts = sd["attention.query_key_value.bias"].view(heads, 3, -1).unbind(1)
        out.update({f"attention.{n}_bias": p.reshape(-1) for n, p in zip(_QKV, parts)})
    return out


def _smp_layer_to_hf(sd: Mapping[str, torch.Tensor], heads: int) -> dict[str, Any]:
    """One layer, our names -> HF's, q/k/v fused back per head."""
    out = {hf: sd[ours] for hf, ours in _PLAIN if ours in sd}
    ws = [sd[f"attention.{n}_weight"] for n in _QKV]
    out["attention.query_key_value.weight"] = torch.stack([w.view(heads, -1, w.shape[-1]) for w in ws], 1).reshape(
        -1, ws[0].shape[-1])  # fmt: skip
    if "attention.query_bias" in sd:
        bs = [sd[f"attention.{n}_bias"].view(heads, -1) for n in _QKV]
        out["attention.query_key_value.bias"] = torch.stack(bs, 1).reshape(-1)
    return out


_heads_seen: set[int] = set()
"""``num_attention_heads`` of the GPT-NeoX models swapped in this process (the translate functions' default)."""


def _heads_of(num_attention_heads: int | None) -> int:
    """The head count that lays out the fused q|k|v rows: given, or that of the one model this process swapped
    (so SMP's one-argument calls work in a training script)."""
    if num_attention_heads is not None:
        return num_attention_heads
    if len(_heads_seen) == 1:
        return next(iter(_heads_seen))
    raise TypeError("GPT-NeoX translation needs num_attention_heads=... (the fused query_key_value rows are laid "
                    "out per head, and this process swapped no single GPT-NeoX model to take it from)")  # fmt: skip


def translate_hf_state_dict_to_smdistributed_gptneox(
    state_dict: Mapping[str, Any], num_attention_heads: int | None = None
) -> OrderedDict[str, Any]:
    """A full HF GPT-NeoX state dict -> the full state dict of the swapped model. ``num_attention_heads`` cuts
    the fused ``query_key_value`` (not an argument of SMP's other translate functions; see ``_heads_of``)."""
    heads = _heads_of(num_attention_heads)
    return _translate(state_dict, "layers.", "seq_layers.", lambda sd: _hf_layer_to_smp(sd, heads))


def translate_state_dict_to_hf_gptneox(
    state_dict: Mapping[str, Any], max_seq_len: int | None = None, num_attention_heads: int | None = None
) -> OrderedDict[str, Any]:
    """The swapped model's full state dict -> stock HF GPT-NeoX names and layouts. ``max_seq_len`` adds the
    causal-mask buffers (``attention.bias``, ``attention.masked_bias``) older Hugging Face versions kept."""
    heads = _heads_of(num_attention_heads)
    out = _translate(state_dict, "seq_layers.", "layers.", lambda sd: _smp_layer_to_hf(sd, heads))
    if max_seq_len is not None:
        add_causal_mask_buffers(out, ".attention.query_key_value.weight", max_seq_len, -1e9)
    return out


def _build(module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    check_overrides("GPT-NeoX", overrides)
    return build_on_device(DistributedGPTNeoXModel, module, overrides, _layer_kwargs(module.config))


def register() -> None:
    """Make ``GPTNeoXModel`` (inside ``GPTNeoXForCausalLM`` etc.) a supported module."""
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXModel

    register_builtin(GPTNeoXModel, _build)
