"""``torch.sagemaker.nn.attn``: SMP's flash-attention modules, computed with torch's
``scaled_dot_product_attention`` (the same results as plain softmax attention up to rounding; on a GPU torch
picks its own flash or memory-efficient kernel).

AWS's 2023 HyperPod scripts (awsome-distributed-training ``11.modelparallel``, ``use_smp_flash_attn 1`` by
default) put ``FlashSelfAttention(attention_dropout_prob=0.0)`` on GPT-NeoX / GPT-2 attention layers and call it
as ``flashmod((q, k, v), causal=True, cast_dtype=dtype, layout="b h s d")`` in place of the layer's ``_attn``.
Signatures follow SMP's reference: the output has the layout of the input; a packed input holds the q, k and v
(or k and v) heads one after the other along its head dimension.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.errors import SMPConfigError, SMPUnsupportedError

__all__ = ["FlashGroupedQueryAttention", "FlashSelfAttention", "attention"]

_LAYOUTS = ("b h s d", "b s h d")


def _heads_dim(layout: str) -> int:
    """Where the heads lie in a 4-D tensor of ``layout`` (SMP's two layouts)."""
    if layout not in _LAYOUTS:
        raise SMPConfigError(f"layout={layout!r}: SMP's flash attention takes 'b h s d' or 'b s h d'")
    return 1 if layout == "b h s d" else 2


def _split(packed: Any, parts: int, layout: str, what: str) -> tuple[torch.Tensor, ...]:
    """A tuple of ``parts`` tensors, or one tensor holding them one after the other along the heads."""
    if isinstance(packed, (tuple, list)):
        if len(packed) != parts:
            raise SMPConfigError(f"{what}: expected {parts} tensors, got {len(packed)}")
        return tuple(packed)
    dim = _heads_dim(layout)
    if packed.dim() != 4 or packed.shape[dim] % parts:
        raise SMPConfigError(f"{what}: a packed tensor of layout {layout!r} needs {parts} x heads along dim {dim}, "
                             f"got shape {tuple(packed.shape)}")  # fmt: skip
    return tuple(packed.chunk(parts, dim=dim))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, layout: str, dropout_p: float = 0.0,
              scale: float | None = None, cast_dtype: torch.dtype | None = None,
              attn_mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Softmax attention of q over k, v in ``layout`` (fewer k/v heads than q heads: grouped-query attention).

    ``attn_mask`` is added to the scores (float) or selects the kept positions (bool), on top of ``causal``.
    """
    dim = _heads_dim(layout)
    if cast_dtype is not None:
        q, k, v = q.to(cast_dtype), k.to(cast_dtype), v.to(cast_dtype)
    if q.shape[dim] % k.shape[dim]:
        raise SMPConfigError(f"{q.shape[dim]} query heads are not a multiple of {k.shape[dim]} key/value heads")
    if dim == 2:  # sdpa wants b h s d
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if causal and attn_mask is not None:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - q.shape[-2])
        attn_mask = attn_mask & keep if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~keep, float("-inf"))
        causal = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip
    return out.transpose(1, 2) if dim == 2 else out


class FlashSelfAttention(nn.Module):
    """SMP's ``FlashSelfAttention(attention_dropout_prob=0.0, scale=None, triton_flash_attention=False,
    use_alibi=False)``: self-attention of a packed or (q, k, v) input; dropout only in training mode.

    ``triton_flash_attention`` chose SMP's kernel and changes nothing here; ``use_alibi`` admits ``attn_mask``,
    the ALiBi bias SMP's docs build (added to the scores), which SMP accepts only with it.
    """

    def __init__(self, attention_dropout_prob: float = 0.0, scale: float | None = None,
                 triton_flash_attention: bool = False, use_alibi: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.attention_dropout_prob = attention_dropout_prob
        self.scale = scale
        self.triton_flash_attention = triton_flash_attention
        self.use_alibi = use_alibi

    def forward(self, qkv: Any, attn_mask: torch.Tensor | None = None, causal: bool = False,
                cast_dtype: torch.dtype | None = None, layout: str = "b h s d") -> torch.Tensor:  # fmt: skip
        if attn_mask is not None and not self.use_alibi:
            raise SMPUnsupportedError("FlashSelfAttention(attn_mask=...) needs use_alibi=True (SMP's ALiBi path); "
                                      "for padding use the model's own attention")  # fmt: skip
        q, k, v = _split(qkv, 3, layout, "qkv")
        dropout = self.attention_dropout_prob if self.training else 0.0
        return attention(q, k, v, causal=causal, layout=layout, dropout_p=dropout, scale=self.scale,
                         cast_dtype=cast_dtype, attn_mask=attn_mask)  # fmt: skip


class FlashGroupedQueryAttention(nn.Module):
    """SMP's ``FlashGroupedQueryAttention(attention_dropout_prob=0.0, scale=None)``: q heads in groups sharing
    each k/v head (the number of q heads a multiple of the k/v heads); dropout only in training mode."""

    def __init__(self, attention_dropout_prob: float = 0.0, scale: float | None = None) -> None:
        super().__init__()
        self.attention_dropout_prob = attention_dropout_prob
        self.scale = scale

    def forward(self, q: torch.Tensor, kv: Any, causal: bool = False, cast_dtype: torch.dtype | None = None,
                layout: str = "b s h d", attn_mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``attn_mask`` (ours, not SMP's): a padding/causal mask the Hugging Face model built, applied as given."""
        k, v = _split(kv, 2, layout, "kv")
        dropout = self.attention_dropout_prob if self.training else 0.0
        return attention(q, k, v, causal=causal, layout=layout, dropout_p=dropout, scale=self.scale,
                         cast_dtype=cast_dtype, attn_mask=attn_mask)  # fmt: skip
