"""``torch.sagemaker.nn``: SMP's flash-attention modules (``attn``, ``huggingface.llama_flashattn``) on torch's
``scaled_dot_product_attention``."""

from __future__ import annotations

__all__: list[str] = []
