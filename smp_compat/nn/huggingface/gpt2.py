"""Hugging Face GPT-2: ``GPT2Model`` swapped for a ``DistributedTransformer``, and state-dict translation.

The replacement keeps HF's ``wte``/``wpe``/``drop``/``ln_f`` modules (so ``lm_head`` stays tied to ``wte``
and HF's own loss runs unchanged) and holds the blocks as ``seq_layers[i]`` with children ``attention``
(pre-LN, fused ``c_attn`` split into q/k/v by whole heads, ``c_proj`` row-parallel) and ``output``
(pre-LN, ``c_fc`` column-parallel, ``c_proj`` row-parallel). The weights are the HF module's own.
"""

from __future__ import annotations

import inspect
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.nn.huggingface.inputs import refuse_unsupported_inputs
from smp_compat.nn.huggingface.building import activation_of, build_on_device, check_overrides
from smp_compat.nn.module import shard
from smp_compat.nn.registry import register_builtin
from smp_compat.nn.transformer import DistributedTransformer

__all__ = ["DistributedGPT2Model", "register", "translate_hf_state_dict_to_smdistributed_gpt2",
           "translate_hf_state_dict_to_smdistributed",
           "translate_state_dict_to_hf_gpt2", "get_hf_gpt2_transformer_layer_hooks"]  # fmt: skip


def _layer_kwargs(config: Any) -> dict[str, Any]:
    """DistributedTransformer arguments equal to a GPT2Config; ValueError for what the swap does not cover."""
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention is not supported by the tensor-parallel swap")
    hidden, heads = config.hidden_size, config.num_attention_heads
    return dict(
        num_layers=config.num_hidden_layers, num_attention_heads=heads, attention_head_size=hidden // heads,
        hidden_size=hidden, intermediate_size=config.n_inner or 4 * hidden,
        attention_dropout_prob=config.attn_pdrop, hidden_dropout_prob=config.resid_pdrop,
        activation=activation_of(config, "activation_function"), layernorm_epsilon=config.layer_norm_epsilon,
        initializer_range=config.initializer_range, use_normal_initialization=True,
        causal_mask_size=config.n_positions, pre_layernorm=True, post_layernorm=False,
        scale_attention_scores=bool(config.scale_attn_weights),
        scale_attn_by_layer_idx=bool(config.scale_attn_by_inverse_layer_idx),
        attention_in_fp32=bool(config.reorder_and_upcast_attn),
    )  # fmt: skip


class DistributedGPT2Model(DistributedTransformer):
    """``GPT2Model`` with its blocks as tensor-parallel ``seq_layers``; same forward signature and output type."""

    def __init__(self, hf: nn.Module, overrides: dict[str, Any] | None = None) -> None:
        kwargs = {**_layer_kwargs(hf.config), **(overrides or {})}
        super().__init__(**kwargs)
        self.config = hf.config
        self.embed_dim = hf.config.hidden_size
        self.wte, self.wpe, self.drop, self.ln_f = hf.wte, hf.wpe, hf.drop, hf.ln_f
        if not any(p.is_meta for p in hf.parameters()):
            with torch.no_grad():
                for block, layer in zip(hf.h, self.seq_layers):
                    _copy_block(block, layer)

    def get_input_embeddings(self) -> nn.Module:
        return self.wte

    def set_input_embeddings(self, new: nn.Module) -> None:
        self.wte = new

    def forward(self, input_ids: torch.Tensor | None = None, past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                use_cache: bool | None = None, **kwargs: Any) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        refuse_unsupported_inputs("GPT-2", dict(kwargs, past_key_values=past_key_values, use_cache=use_cache,
                                  encoder_hidden_states=encoder_hidden_states, attention_mask=attention_mask,
                                  position_ids=position_ids), packed_positions=True)
        h, mask, shape = embed_with_mask(self, input_ids, inputs_embeds, position_ids, token_type_ids, attention_mask)
        h = self.seq_layers((h, mask))[0]
        h = self.ln_f(h).view(*shape, h.shape[-1])
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=h)


def embed_with_mask(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Size]:
    """HF GPT-style input embedding (``wte`` + ``wpe`` (+ token types), dropout) and the additive mask
    ``[N, 1, 1, S]`` the distributed layers take; also the input's shape (without the hidden size)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You have to specify exactly one of input_ids or inputs_embeds")
    shape = input_ids.shape if input_ids is not None else inputs_embeds.shape[:-1]
    h = model.wte(input_ids.view(-1, shape[-1])) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        position_ids = torch.arange(shape[-1], device=h.device).unsqueeze(0)
    h = h + model.wpe(position_ids)
    if token_type_ids is not None:
        h = h + model.wte(token_type_ids.view(-1, shape[-1]))
    h = model.drop(h)
    mask = None
    if attention_mask is not None:
        keep = attention_mask.view(h.shape[0], -1).to(h.dtype)
        mask = ((1.0 - keep) * torch.finfo(h.dtype).min)[:, None, None, :]
    return h, mask, shape


def _copy_block(block: nn.Module, layer: nn.Module) -> None:
    """HF GPT2Block weights (Conv1D: [in, out]) into this rank's shards of a DistributedTransformerLayer."""
    attn, out = layer.attention, layer.output
    full = _hf_block_to_smp(block.state_dict())
    for module in (attn, out):
        prefix = "attention." if module is attn else "output."
        for name, param in module.named_parameters():
            value = full[prefix + name]
            param.copy_(shard(value, param._smp_tp_dim) if hasattr(param, "_smp_tp_dim") else value)


def _hf_block_to_smp(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One block, HF names -> our names, whole tensors."""
    q, k, v = sd["attn.c_attn.weight"].t().chunk(3, dim=0)
    qb, kb, vb = sd["attn.c_attn.bias"].chunk(3, dim=0)
    return {
        "attention.query_weight": q, "attention.key_weight": k, "attention.value_weight": v,
        "attention.query_bias": qb, "attention.key_bias": kb, "attention.value_bias": vb,
        "attention.dense_weight": sd["attn.c_proj.weight"].t(), "attention.dense_bias": sd["attn.c_proj.bias"],
        "attention.layernorm.weight": sd["ln_1.weight"], "attention.layernorm.bias": sd["ln_1.bias"],
        "output.dense1_weight": sd["mlp.c_fc.weight"].t(), "output.dense1_bias": sd["mlp.c_fc.bias"],
        "output.dense2_weight": sd["mlp.c_proj.weight"].t(), "output.dense2_bias": sd["mlp.c_proj.bias"],
        "output.layernorm.weight": sd["ln_2.weight"], "output.layernorm.bias": sd["ln_2.bias"],
    }  # fmt: skip


def _smp_block_to_hf(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    a = "attention."
    return {
        "ln_1.weight": sd[a + "layernorm.weight"], "ln_1.bias": sd[a + "layernorm.bias"],
        "attn.c_attn.weight": torch.cat([sd[a + f"{n}_weight"] for n in ("query", "key", "value")], 0).t().contiguous(),
        "attn.c_attn.bias": torch.cat([sd[a + f"{n}_bias"] for n in ("query", "key", "value")], 0),
        "attn.c_proj.weight": sd[a + "dense_weight"].t().contiguous(), "attn.c_proj.bias": sd[a + "dense_bias"],
        "ln_2.weight": sd["output.layernorm.weight"], "ln_2.bias": sd["output.layernorm.bias"],
        "mlp.c_fc.weight": sd["output.dense1_weight"].t().contiguous(), "mlp.c_fc.bias": sd["output.dense1_bias"],
        "mlp.c_proj.weight": sd["output.dense2_weight"].t().contiguous(), "mlp.c_proj.bias": sd["output.dense2_bias"],
    }  # fmt: skip


def _translate(state_dict: Mapping[str, Any], pattern: str, repl: str, convert: Any) -> OrderedDict[str, Any]:
    """Rewrite every block ``{prefix}{pattern}{i}.{rest}`` with ``convert``; other keys pass through."""
    blocks: dict[tuple[str, int], dict[str, Any]] = {}
    out: OrderedDict[str, Any] = OrderedDict()
    regex = re.compile(rf"^(.*?){re.escape(pattern)}(\d+)\.(.+)$")
    for key, value in state_dict.items():
        m = regex.match(key)
        if m is None:
            out[key] = value
        else:
            blocks.setdefault((m.group(1), int(m.group(2))), {})[m.group(3)] = value
    for (prefix, i), sd in sorted(blocks.items(), key=lambda item: item[0][1]):
        sd = {k: v for k, v in sd.items() if k not in ("attn.bias", "attn.masked_bias")}
        for name, value in convert(sd).items():
            out[f"{prefix}{repl}{i}.{name}"] = value
    return out


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A full HF GPT-2 state dict -> the full state dict of the swapped model (``model.load_state_dict`` input)."""
    return _translate(state_dict, "h.", "seq_layers.", _hf_block_to_smp)


def translate_hf_state_dict_to_smdistributed(
    state_dict: Mapping[str, Any], max_seq_len: int | None = None
) -> OrderedDict[str, Any]:
    """The name AWS's 2021-22 GPT-2 script imports (``translate_hf_state_dict_to_smdistributed(sd, seq_length)``).
    The causal-mask buffers ``max_seq_len`` sized are dropped on this side, so the length changes nothing."""
    del max_seq_len
    return translate_hf_state_dict_to_smdistributed_gpt2(state_dict)


def translate_state_dict_to_hf_gpt2(
    state_dict: Mapping[str, Any], max_seq_len: int | None = None
) -> OrderedDict[str, Any]:
    """The full state dict of the swapped model -> stock HF GPT-2 names and layouts. ``max_seq_len`` adds the
    causal-mask buffers (``attn.bias``, ``attn.masked_bias``) that Hugging Face versions before 4.32 kept."""
    out = _translate(state_dict, "seq_layers.", "h.", _smp_block_to_hf)
    if max_seq_len is not None:
        add_causal_mask_buffers(out, ".attn.c_attn.weight", max_seq_len, -1e4)
    return out


def add_causal_mask_buffers(out: dict[str, Any], weight_suffix: str, max_seq_len: int, masked_bias: float) -> None:
    """Old Hugging Face attention modules' ``bias`` (causal mask) and ``masked_bias`` buffers, next to each
    attention whose weight ends in ``weight_suffix``: what a translation with ``max_seq_len`` recreates."""
    causal = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.bool)).view(1, 1, max_seq_len, max_seq_len)
    cut = len(weight_suffix.rsplit(".", 2)[-2]) + len(".weight")
    for key in [k for k in out if k.endswith(weight_suffix)]:
        base = key[:-cut]
        out[base + "bias"] = causal.clone()
        out[base + "masked_bias"] = torch.tensor(masked_bias)


def _build(module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    layer_args = _layer_kwargs(module.config)  # ValueError first: the model stays unswapped
    check_overrides("GPT-2", overrides)
    return build_on_device(DistributedGPT2Model, module, overrides, layer_args)


def register() -> None:
    """Make ``GPT2Model`` (inside ``GPT2LMHeadModel`` etc.) a supported module."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model

    register_builtin(GPT2Model, _build)


def get_hf_gpt2_transformer_layer_hooks() -> tuple[Any, Any, Any]:
    """``(init_hook, forward_hook, return_hook)`` for ``tp_register_with_module(GPT2Block,
    smp.nn.DistributedTransformerLayer, *hooks)``, for the installed transformers' ``GPT2Block`` (4.x or 5.x).
    Mark the blocks with ``smp.set_tensor_parallelism(block)`` so the whole ``GPT2Model`` is not swapped instead."""
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    signature = inspect.signature(GPT2Block.forward)  # the arguments' names and order differ across versions
    returns_tuple = int(transformers.__version__.split(".")[0]) < 5  # 4.x: (hidden, present, ...); 5.x: hidden
    layers: list[int] = []  # the model's block count, from the config init_hook sees

    def init_hook(config: Any, layer_idx: int | None = None) -> tuple[tuple, dict[str, Any]]:
        kwargs = _layer_kwargs(config)
        layers[:] = [kwargs.pop("num_layers")]
        return (), {**kwargs, "layer_idx": layer_idx}

    def forward_hook(*args: Any, **kwargs: Any) -> tuple[tuple, dict[str, Any]]:
        bound = signature.bind(None, *args, **kwargs).arguments
        bound.update(bound.pop("kwargs", {}))
        _refuse_block_inputs(bound, layers[0] if layers else None)
        hidden_states, mask = bound["hidden_states"], bound.get("attention_mask")
        if mask is not None and mask.dtype == torch.bool:  # HF's 4-D mask: True = attend
            zeros = torch.zeros(mask.shape, dtype=hidden_states.dtype, device=mask.device)
            mask = zeros.masked_fill(~mask, torch.finfo(hidden_states.dtype).min)
        return ((hidden_states, mask),), {}

    def return_hook(output: tuple[torch.Tensor, ...]) -> Any:
        hidden = output[0]
        if not returns_tuple:
            return hidden
        # 4.x's GPT2Model keeps outputs[1] as the layer's cache entry: a zero-memory placeholder of the right
        # length, so generation's next step hands it back and is refused (never fed the new token alone)
        mark = hidden.new_zeros(()).expand(hidden.shape[0], 1, hidden.shape[1], 1)
        return hidden, (mark, mark)

    return init_hook, forward_hook, return_hook


def _refuse_block_inputs(bound: dict[str, Any], layers: int | None) -> None:
    """HF hands every block a cache when use_cache is on (its default, also in training); the layer does not fill
    it. A cache that holds tokens, that already went through every block (generation's next step, which feeds
    only the new tokens), or a 4.x ``layer_past`` is refused, never misused; so are cross-attention, a head mask
    and per-layer outputs."""
    cache = next((bound.get(n) for n in ("cache", "past_key_values") if bound.get(n) is not None), None)
    if cache is not None and hasattr(cache, "get_seq_length"):
        passes = getattr(cache, "_smp_unfilled_passes", 0)
        if cache.get_seq_length() > 0 or (layers is not None and passes >= layers):
            cache = "filled"
        else:
            cache._smp_unfilled_passes = passes + 1
            cache = None
    if cache is not None or bound.get("layer_past") is not None:
        raise SMPUnsupportedError("a filled past_key_values / cache (KV cache; generate() needs one) in a "
                                  "tensor-parallel GPT2Block: decode with use_cache=False")  # fmt: skip
    asked = [n for n in ("encoder_hidden_states", "head_mask", "output_attentions") if bound.get(n) not in (None, False)]
    if asked:
        raise SMPUnsupportedError(f"{', '.join(asked)} in a tensor-parallel GPT2Block")
