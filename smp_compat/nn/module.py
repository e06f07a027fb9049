"""``smp.nn.DistributedModule`` and the helpers that turn a full tensor into this rank's shard.

Every distributed parameter is created full-size from the global RNG on every rank, then sliced
(SMP >= 1.15), so a tp run starts from exactly the weights a tp = 1 run gets with the same seed.
A shard remembers the dimension it was cut along (``_smp_tp_dim``) so state dicts can gather it, and the
whole tensor's shape (``_smp_tp_shape``), which a checkpoint's shard record needs even where the pipeline
stage holding the parameter is another rank's (its local tensor is then empty).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from smp_compat.globalstate import state
from smp_compat.nn.comm import tp_index, tp_world

__all__ = ["DistributedModule", "FusedLayerNorm", "shard", "is_shard", "tp_rng", "divide"]


class DistributedModule(nn.Module):
    """Base of every tensor-parallel module (the class ``isinstance`` checks and ``tp_register`` expect)."""


class FusedLayerNorm(nn.LayerNorm):
    """SMP's apex-FusedLayerNorm stand-in: ``torch.nn.LayerNorm`` (same numerics; torch fuses it on GPU)."""


def divide(value: int, what: str) -> int:
    """``value / tp``; a clear error when it does not divide."""
    n = tp_world()
    if value % n:
        raise ValueError(f"{what} ({value}) is not divisible by tensor_parallel_degree ({n})")
    return value // n


def shard(full: torch.Tensor, dim: int, blocks: int = 1) -> nn.Parameter:
    """This rank's slice of ``full`` along ``dim`` as a new parameter, tagged as distributed.

    ``blocks`` > 1 cuts each of ``blocks`` equal sections separately (a fused q|k|v weight), keeping
    whole sections per rank so heads stay together.
    """
    n, me = tp_world(), tp_index()
    sections = full.chunk(blocks, dim=dim) if blocks > 1 else (full,)
    local = torch.cat([s.chunk(n, dim=dim)[me] for s in sections], dim=dim) if n > 1 else full
    param = nn.Parameter(local.detach().clone().contiguous())
    param._smp_tp_dim = dim  # type: ignore[attr-defined]
    param._smp_tp_blocks = blocks  # type: ignore[attr-defined]
    param._smp_tp_shape = tuple(full.shape)  # type: ignore[attr-defined]
    return param


def is_shard(param: torch.Tensor) -> bool:
    return hasattr(param, "_smp_tp_dim")


_SEED_RANGE = 2**62


@contextlib.contextmanager
def tp_rng() -> Iterator[None]:
    """Run dropout inside a sharded region on a CPU generator stream of its own, seeded from one draw of the
    global generator, ``tensor_parallel_seed`` and the tp rank (different masks per shard, as SMP/Megatron).

    Seeding from the global generator makes the region replay: activation checkpointing restores the global
    state before it recomputes, so the recomputation draws the same mask. A stream that only moved on gave the
    recomputation other masks, and so wrong gradients. Under ``deterministic_server`` the global generator is
    the microbatch's own stream (runtime/rng_streams.py), so the masks do not depend on task order either.
    """
    if tp_world() == 1:
        yield
        return
    draw = int(torch.randint(0, _SEED_RANGE, (1,)).item())
    outer = torch.get_rng_state()
    seed = hash((draw, state.cfg.tensor_parallel_seed if state.initialized else 0, tp_index())) % _SEED_RANGE
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(outer)


KERNEL_FLAGS = frozenset({
    "fused_softmax", "fused_bias_gelu", "fused_dropout", "attention_in_fp32", "query_key_layer_scaling",
    "flash_attention", "fp32_residual_addition", "distribute_embedding", "zero_init", "layer_idx",
})  # fmt: skip
"""Keyword arguments SMP's transformer modules took beyond their documented signature (see docs/config.md)."""


def check_flags(owner: str, flags: dict[str, object]) -> None:
    """Unknown keyword arguments are a TypeError, as for any Python constructor."""
    unknown = sorted(set(flags) - KERNEL_FLAGS)
    if unknown:
        raise TypeError(
            f"{owner}() got unexpected keyword arguments {unknown}; known extra flags: {sorted(KERNEL_FLAGS)}"
        )
