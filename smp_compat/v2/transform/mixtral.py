"""Mixtral: Llama's attention (GQA) split over tp; the sparse-MoE block (router and every expert) stays whole
on each tp rank. Its input is the attention output after the row-wise all-reduce, the same on every tp rank,
so each rank routes the same tokens to the same experts and computes the block in full: the experts'
gradients are equal across the tp group and FSDP reduces them over data parallelism only, as for the norms.
Both transformers layouts (4.x's ``block_sparse_moe``, 5's ``mlp``) pass through unchanged."""

from __future__ import annotations

import dataclasses

from smp_compat.v2.transform import llama

__all__ = ["FAMILY"]

FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="Mixtral",
    model_types=("mixtral",),
    intermediate=lambda config: 0,  # no MLP split: the experts stay whole, any intermediate_size fits
    blocks=("self_attn",),
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    rowwise=("self_attn.o_proj",),
)
