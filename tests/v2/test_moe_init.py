"""Delayed initialization of MoE experts gives the same weights at any expert_parallel_degree."""

from __future__ import annotations

import torch
from torch import nn

from smp_compat.v2.moe.moe_layer import LocalExperts

TOTAL, HIDDEN, INTER = 4, 8, 6


def _experts(first: int, local: int) -> LocalExperts:
    nan = float("nan")
    gate_up = torch.full((local, 2 * INTER, HIDDEN), nan)
    down = torch.full((local, HIDDEN, INTER), nan)
    return LocalExperts(gate_up, down, nn.SiLU(), first=first, init_std=0.02, total=TOTAL)


def _reset(experts: LocalExperts) -> torch.Tensor:
    """Seeded reset; returns the next draw of the random stream, to compare what the reset consumed."""
    torch.manual_seed(7)
    experts.reset_parameters()
    return torch.randn(3)


def test_each_ep_rank_gets_its_rows_of_the_ep1_init_and_the_stream_continues_alike() -> None:
    whole = _experts(0, TOTAL)
    after_whole = _reset(whole)
    assert not whole.gate_up_proj.isnan().any() and not whole.down_proj.isnan().any()
    assert 0.01 < whole.gate_up_proj.std().item() < 0.03  # normal(0, initializer_range)
    for ep in (2, 4):
        per = TOTAL // ep
        for rank in range(ep):
            part = _experts(rank * per, per)
            after_part = _reset(part)
            rows = slice(rank * per, (rank + 1) * per)
            assert torch.equal(part.gate_up_proj, whole.gate_up_proj[rows]), (ep, rank)
            assert torch.equal(part.down_proj, whole.down_proj[rows]), (ep, rank)
            assert torch.equal(after_part, after_whole), (ep, rank)
