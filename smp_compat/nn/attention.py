"""``smp.nn.DistributedAttentionLayer`` (heads split over the tp group) and ``smp.nn.FlashAttentionLayer``.

The kernel flags SMP took (``fused_softmax``, ``fused_dropout``, ``attention_in_fp32``,
``query_key_layer_scaling``, ``flash_attention``) select how the same math is computed:
``attention_in_fp32`` upcasts scores and softmax, ``query_key_layer_scaling`` divides the scores by the
layer number before the product and multiplies back in fp32 (Megatron's overflow guard, mathematically
neutral), ``flash_attention`` uses ``torch.nn.functional.scaled_dot_product_attention``; the fused ones
are plain torch here (torch fuses what it can).
"""

from __future__ import annotations

import contextlib

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.nn import comm
from smp_compat.nn.module import DistributedModule, check_flags, divide, shard, tp_rng

__all__ = ["DistributedAttentionLayer", "FlashAttentionLayer", "attention_scores", "full_linear"]


def full_linear(in_features: int, out_features: int, normal: bool, std: float) -> nn.Linear:
    """A full-size ``nn.Linear`` initialized from the global RNG (torch's default init, or N(0, std) and zero bias)."""
    layer = nn.Linear(in_features, out_features)
    if normal:
        with torch.no_grad():
            layer.weight.normal_(0.0, std)
            layer.bias.zero_()
    return layer


class AttentionMath:
    """The score/softmax/dropout/context part, shared by the distributed layer and FlashAttentionLayer."""

    def __init__(self, head_size: int, dropout: float, scale_scores: bool, layer_scale: float, flags: dict[str, Any]):
        self.scale = (1.0 / math.sqrt(head_size) if scale_scores else 1.0) / layer_scale
        self.dropout = dropout
        self.in_fp32 = bool(flags.get("attention_in_fp32", False))
        self.qk_layer_scaling = int(flags.get("layer_idx") or 0) + 1 if flags.get("query_key_layer_scaling") else 1
        self.flash = bool(flags.get("flash_attention", False))
        self.window_size: int | None = None  # local (sliding-window) causal attention, as GPT-Neo's local layers

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool, training: bool) -> torch.Tensor:  # fmt: skip
        """q, k, v: [N, heads, S, d]; ``mask`` additive, broadcastable to [N, heads, S, S_k] -> [N, heads, S, d]."""
        p = self.dropout if training else 0.0
        if causal:
            mask = _add_causal(mask, q.shape[-2], k.shape[-2], q.dtype, q.device, self.window_size)
        if self.flash and not self.in_fp32:
            with tp_rng() if p else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=self.scale)
        scores = attention_scores(q, k, self.scale, self.qk_layer_scaling, self.in_fp32)
        if mask is not None:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1).to(v.dtype)
        if p:
            with tp_rng():
                probs = F.dropout(probs, p, True)
        return torch.matmul(probs, v)


def attention_scores(q: torch.Tensor, k: torch.Tensor, scale: float, layer_scaling: int, in_fp32: bool) -> torch.Tensor:
    if in_fp32 or layer_scaling > 1:
        q, k = q.float(), k.float()
    scores = torch.matmul(q * (scale / layer_scaling), k.transpose(-1, -2)) if layer_scaling > 1 else (
        torch.matmul(q, k.transpose(-1, -2)) * scale)  # fmt: skip
    return scores * layer_scaling if layer_scaling > 1 else scores


def _add_causal(
    mask: torch.Tensor | None, s_q: int, s_k: int, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """The additive causal mask (only the last ``window`` keys when given), combined with ``mask`` (clamped so
    two masks never sum to -inf)."""
    lowest = torch.finfo(dtype).min
    ones = torch.ones(s_q, s_k, dtype=torch.bool, device=device)
    causal = ones.tril(s_k - s_q)
    if window is not None:
        causal = causal & ~ones.tril(s_k - s_q - window)
    additive = torch.zeros(s_q, s_k, dtype=dtype, device=device).masked_fill(~causal, lowest)
    return additive if mask is None else torch.clamp(mask + additive, min=lowest)


class DistributedAttentionLayer(DistributedModule):
    """Multi-head attention with whole heads per tp rank: q/k/v column-parallel, ``dense`` row-parallel.

    ``forward((hidden_states [N,S,H], attention_mask [N,1,1,S] additive))`` or, with ``cross_attention``,
    ``forward((hidden_states, cross_states, attention_mask))``; returns the layer output ``[N,S,H]``
    (the residual is added: ``layernorm(out + h)`` post-LN, ``out + h`` pre-LN).
    """

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        cross_attention: bool = False,
        causal_mask_size: int | None = None,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        scale_attention_scores: bool = True,
        scale_attn_by_layer_idx: bool = False,
        layer_idx: int | None = None,
        use_alibi: bool = False,
        attention_bias: bool = True,
        **flags: Any,
    ) -> None:
        super().__init__()
        check_flags("DistributedAttentionLayer", flags)
        if use_alibi:
            raise SMPUnsupportedError("ALiBi attention (use_alibi=True) in smp.nn attention layers")
        if not (pre_layernorm or post_layernorm):
            raise ValueError("DistributedAttentionLayer needs pre_layernorm or post_layernorm (or both) True")
        self.num_attention_heads, self.attention_head_size = num_attention_heads, attention_head_size
        self.hidden_size = hidden_size
        self.local_heads = divide(num_attention_heads, "num_attention_heads")
        self.cross_attention, self.causal_mask_size = cross_attention, causal_mask_size
        self.pre_layernorm, self.post_layernorm = pre_layernorm, post_layernorm
        inner = num_attention_heads * attention_head_size
        normal = use_normal_initialization
        self._init = (inner, normal, initializer_range)
        q, k, v = (full_linear(hidden_size, inner, normal, initializer_range) for _ in range(3))
        dense = full_linear(inner, hidden_size, normal, initializer_range)
        self.query_weight, self.key_weight, self.value_weight = (shard(m.weight.data, 0) for m in (q, k, v))
        # attention_bias False (GPT-Neo): q/k/v without bias; not an SMP argument
        bias = [shard(m.bias.data, 0) if attention_bias else None for m in (q, k, v)]
        self.query_bias, self.key_bias, self.value_bias = bias
        self.dense_weight, self.dense_bias = shard(dense.weight.data, 1), nn.Parameter(dense.bias.data.clone())
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        layer_scale = float(layer_idx + 1) if scale_attn_by_layer_idx and layer_idx is not None else 1.0
        self.math = AttentionMath(attention_head_size, attention_dropout_prob, scale_attention_scores, layer_scale,
                                  {**flags, "layer_idx": layer_idx})  # fmt: skip

    def reset_parameters(self) -> None:
        """Delayed initialization: whole tensors from the global RNG as in the constructor, then this rank's slices."""
        inner, normal, std = self._init
        full = [full_linear(self.hidden_size, inner, normal, std) for _ in range(3)]
        full.append(full_linear(inner, self.hidden_size, normal, std))
        with torch.no_grad():
            for (w, b), layer in zip(((self.query_weight, self.query_bias), (self.key_weight, self.key_bias),
                                      (self.value_weight, self.value_bias)), full):  # fmt: skip
                w.copy_(shard(layer.weight.data, 0))
                if b is not None:
                    b.copy_(shard(layer.bias.data, 0))
            self.dense_weight.copy_(shard(full[3].weight.data, 1))
            if self.dense_bias is not None:  # None in GPT-J's attention (see huggingface/rotary_blocks.py)
                self.dense_bias.copy_(full[3].bias.data)

    def _heads(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n, s = x.shape[:2]
        return F.linear(x, w, b).view(n, s, self.local_heads, self.attention_head_size).transpose(1, 2)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.cross_attention:
            hidden, cross, mask = inputs
        else:
            (hidden, mask), cross = inputs, None
        x = self.layernorm(hidden) if self.pre_layernorm else hidden
        x_all = comm.enter_region(x)
        kv_all = x_all if cross is None else comm.enter_region(cross)
        mask_all = comm.gather_mask(mask, x.shape[0], x.shape[1], kv_all.shape[1], x.dtype)
        q = self._heads(x_all, self.query_weight, self.query_bias)
        k = self._heads(kv_all, self.key_weight, self.key_bias)
        v = self._heads(kv_all, self.value_weight, self.value_bias)
        causal = self.causal_mask_size is not None and cross is None
        context = self.math(q, k, v, mask_all, causal, self.training)
        context = context.transpose(1, 2).reshape(*x_all.shape[:2], -1)
        out = self.dropout2(comm.exit_region(F.linear(context, self.dense_weight)) + self.dense_bias)
        if self.post_layernorm:
            out = self.layernorm(out + hidden) if not self.pre_layernorm else out + hidden
            return out
        return out + hidden


class FlashAttentionLayer(nn.Module):
    """SMP's ``FlashAttentionLayer``: ``forward(qkv [B,S,3,heads,d], attn_mask=None, causal=False) -> [B,heads,S,d]``,
    computed with ``scaled_dot_product_attention`` (flash kernels on GPU where torch has them)."""

    def __init__(
        self,
        attention_dropout_prob: float = 0.1,
        attention_head_size: int | None = None,
        scale_attention_scores: bool = True,
        scale_attn_by_layer_idx: bool = False,
        layer_idx: int | None = None,
        scale: float | None = None,
        triton_flash_attention: bool = False,
        use_alibi: bool = False,
    ) -> None:
        super().__init__()
        if triton_flash_attention or use_alibi:
            raise SMPUnsupportedError("FlashAttentionLayer with triton_flash_attention or use_alibi (Triton kernels)")
        self.dropout = attention_dropout_prob
        self.attention_head_size, self.scale = attention_head_size, scale
        self.scale_attention_scores = scale_attention_scores
        self.layer_divisor = float(layer_idx + 1) if scale_attn_by_layer_idx and layer_idx is not None else 1.0

    def forward(self, qkv: torch.Tensor, attn_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=2))
        head = self.attention_head_size or q.shape[-1]
        scale = self.scale
        if scale is None:
            scale = 1.0 / math.sqrt(head) if self.scale_attention_scores else 1.0
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # True = attend, as in torch's SDPA
            zeros = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
            attn_mask = zeros.masked_fill(~attn_mask, torch.finfo(q.dtype).min)
        if causal:
            attn_mask = _add_causal(attn_mask, q.shape[-2], k.shape[-2], q.dtype, q.device)
        p = self.dropout if self.training else 0.0
        scale = scale / self.layer_divisor
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, scale=scale)
