"""The MoE router's selections and losses (smp_compat/v2/moe/routing.py), checked by their defining properties."""

from __future__ import annotations

import math

import pytest
import torch

from smp_compat.v2.moe import routing


def _logits(tokens: int = 64, experts: int = 8, skew: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(tokens, experts, generator=g) + skew * torch.linspace(0, 1, experts)  # favours the last


def test_none_is_mixtral_top_k_softmax_renormalized() -> None:
    logits = _logits()
    weights, indices = routing.route(logits, 2, "none", training=True)
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, 2, -1)
    assert torch.equal(indices, top.indices)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))


def test_sinkhorn_balances_selection_while_training_only() -> None:
    logits = _logits()
    plain = torch.bincount(routing.route(logits, 2, "none", True)[1].flatten(), minlength=8)
    balanced = torch.bincount(routing.route(logits, 2, "sinkhorn", True)[1].flatten(), minlength=8)
    assert plain.max() - plain.min() > balanced.max() - balanced.min()
    scaled = routing.sinkhorn(logits)
    torch.testing.assert_close(scaled.sum(0), torch.full((8,), 1 / 8), atol=1e-3, rtol=0)
    assert torch.equal(routing.route(logits, 2, "sinkhorn", False)[1], routing.route(logits, 2, "none", False)[1])


def test_balanced_gives_each_token_k_distinct_experts_within_capacity() -> None:
    logits = _logits(tokens=30)
    weights, indices = routing.route(logits, 2, "balanced", True)
    counts = torch.bincount(indices.flatten(), minlength=8)
    assert counts.max() <= math.ceil(30 * 2 / 8)
    assert all(len(set(row.tolist())) == 2 for row in indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(30))


def test_aux_loss_is_coeff_when_uniform_and_grows_with_imbalance() -> None:
    uniform = torch.zeros(8, 4)
    idx = torch.arange(16).view(8, 2) % 4
    assert routing.aux_loss(uniform, idx, 0.01).item() == pytest.approx(0.01)
    skewed = _logits(8, 4, skew=5.0)
    assert routing.aux_loss(skewed, torch.topk(skewed, 2).indices, 0.01).item() > 0.01


def test_z_loss_formula() -> None:
    logits = _logits()
    want = 0.001 * torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(routing.z_loss(logits, 0.001), want)
