"""``torch.sagemaker.nn.huggingface.llama_flashattn``: SMP's Llama attention for transformers < 4.37.1 (imported
by AWS's scripts in a branch newer transformers never take)."""

from __future__ import annotations

from smp_compat.v2.nn.refused import RefusedModule

__all__ = ["LlamaFlashAttention"]


class LlamaFlashAttention(RefusedModule):
    _why = ("it replaced Llama's attention on transformers < 4.37.1. Use the model's own attention "
            "(attn_implementation='sdpa' or 'flash_attention_2') instead.")  # fmt: skip
