"""``smp.nn``: SMP's tensor-parallel modules (Megatron-style splits over the tp group) and fused stand-ins."""

from __future__ import annotations

from smp_compat.nn.attention import DistributedAttentionLayer, FlashAttentionLayer
from smp_compat.nn.linear import DistributedEmbedding, DistributedLinear
from smp_compat.nn.module import DistributedModule, FusedLayerNorm
from smp_compat.nn.transformer import (
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)

__all__ = [
    "DistributedModule", "DistributedLinear", "DistributedEmbedding", "DistributedTransformerLMHead",
    "DistributedTransformer", "DistributedTransformerLayer", "DistributedAttentionLayer",
    "DistributedTransformerOutputLayer", "FusedLayerNorm", "FlashAttentionLayer",
]  # fmt: skip

from smp_compat.nn import huggingface  # noqa: E402 - after the modules it builds on
