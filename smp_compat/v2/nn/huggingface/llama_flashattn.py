"""``torch.sagemaker.nn.huggingface.llama_flashattn``: SMP's ``LlamaFlashAttention(config)``, the installed
transformers' Llama attention computing its scores with :class:`~smp_compat.v2.nn.attn.FlashGroupedQueryAttention`
(torch's ``scaled_dot_product_attention``).

AWS's 2023 HyperPod scripts (``11.modelparallel``) put one on every decoder layer with ``use_smp_flash_attn 1``
and copy the layer's q/k/v/o weights into it, so it is the model's own attention class with only the kernel
changed: same parameters, same call and return as the layer it replaces, on every transformers the project
supports. transformers >= 4.48 looks the kernel up by name (``AttentionInterface``; registered here as
``smp_flash_attention`` on this module's copy of the config); 4.40 - 4.47 have their SDPA class, used as it is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.models.llama import modeling_llama

from smp_compat.v2.nn.attn import FlashGroupedQueryAttention

__all__ = ["LlamaFlashAttention"]

_KERNEL = "smp_flash_attention"
_SDPA_CLASSES = getattr(modeling_llama, "LLAMA_ATTENTION_CLASSES", None)  # transformers < 4.48
_BASE: Any = _SDPA_CLASSES["sdpa"] if _SDPA_CLASSES else modeling_llama.LlamaAttention


def _smp_flash_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention-kernel signature (b h s d in, b s h d out) over the module's flash attention.

    A mask the model built (padding, or the causal mask itself) is applied as given; without one the
    attention is causal, as Hugging Face's own kernels do.
    """
    mask = attention_mask
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, : key.shape[-2]]
    causal = mask is None and query.shape[2] > 1
    flash: FlashGroupedQueryAttention = module.flash_attn  # type: ignore[assignment]
    out = flash(query, (key, value), causal=causal, layout="b h s d", attn_mask=mask)
    return out.transpose(1, 2).contiguous(), None


if _SDPA_CLASSES is None:
    from transformers import AttentionInterface

    AttentionInterface.register(_KERNEL, _smp_flash_attention)


class LlamaFlashAttention(_BASE):  # type: ignore[misc, valid-type]
    """Llama's attention with SMP's flash kernel: ``LlamaFlashAttention(config)`` as AWS's scripts build it."""

    def __init__(self, config: Any, layer_idx: int | None = None) -> None:
        if _SDPA_CLASSES is None:
            config = copy.copy(config)  # the model's own config keeps its kernel
            config._attn_implementation = _KERNEL
        super().__init__(config, layer_idx)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.flash_attn = FlashGroupedQueryAttention(attention_dropout_prob=config.attention_dropout,
                                                     scale=head_dim**-0.5)  # fmt: skip
