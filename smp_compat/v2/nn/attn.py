"""``torch.sagemaker.nn.attn``: SMP's flash-attention kernels. AWS's scripts build them only when
``use_smp_flash_attn`` is set on transformers < 4.37.1; on newer transformers they use the model's own
attention (smp_compat runs ``flash_attention_2`` as sdpa when flash-attn is absent)."""

from __future__ import annotations

from smp_compat.v2.nn.refused import RefusedModule

__all__ = ["FlashSelfAttention", "FlashGroupedQueryAttention"]

_WHY = ("SMP's own flash-attention modules need its CUDA kernels. Use the model's attention "
        "(attn_implementation='sdpa' or 'flash_attention_2') instead.")  # fmt: skip


class FlashSelfAttention(RefusedModule):
    _why = _WHY


class FlashGroupedQueryAttention(RefusedModule):
    _why = _WHY
