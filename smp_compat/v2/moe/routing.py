"""The MoE router: which experts each token goes to, with what weight, and the router's auxiliary losses.

``MoEConfig.moe_load_balancing`` picks the selection; the weights are always Mixtral's: the softmax
probabilities of the chosen experts, renormalized to sum to one per token, so ``"none"`` routes exactly as
Hugging Face's Mixtral does. Selection:

- ``"none"`` and ``"aux_loss"``: the top-k softmax probabilities (``"aux_loss"`` adds the Switch-Transformer
  load-balancing loss, :func:`aux_loss`).
- ``"sinkhorn"``: while training, the top-k of a Sinkhorn-balanced copy of the scores (no gradient through
  the balancing), as Megatron's sinkhorn router; in eval, plain top-k.
- ``"balanced"``: while training, a greedy balanced assignment: pairs are taken in descending probability,
  each expert accepting at most ``ceil(tokens * k / experts)`` of them, so no expert gets more than its even
  share; in eval, plain top-k.

No capacity limit and no token is dropped (SMP's documentation states no capacity factor; dropless).
"""

from __future__ import annotations

import math

import torch

__all__ = ["route", "aux_loss", "z_loss", "sinkhorn"]

SINKHORN_TOL = 1e-4
SINKHORN_MAX_ITERS = 100


def route(logits: torch.Tensor, top_k: int, mode: str, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert indices [T, k]) for router ``logits`` [T, E]."""
    probs = torch.softmax(logits.float(), dim=-1)
    if training and mode == "sinkhorn":
        with torch.no_grad():
            indices = torch.topk(sinkhorn(logits.detach().float()), top_k, dim=-1).indices
    elif training and mode == "balanced":
        indices = balanced_assignment(probs.detach(), top_k)
    else:
        indices = torch.topk(probs, top_k, dim=-1).indices
    weights = torch.gather(probs, 1, indices)
    return weights / weights.sum(dim=-1, keepdim=True), indices


def sinkhorn(logits: torch.Tensor) -> torch.Tensor:
    """Scale ``exp(logits)`` [T, E] until rows and columns are (nearly) balanced; the balanced matrix."""
    cost = torch.exp(logits - logits.max())
    tokens, experts = cost.shape
    row = torch.ones(tokens, dtype=cost.dtype, device=cost.device)
    col = torch.ones(experts, dtype=cost.dtype, device=cost.device)
    for _ in range(SINKHORN_MAX_ITERS):
        new_row = (1.0 / tokens) / (cost @ col + 1e-8)
        new_col = (1.0 / experts) / (new_row @ cost + 1e-8)
        moved = (new_row - row).abs().max()
        row, col = new_row, new_col
        if moved < SINKHORN_TOL:
            break
    return row[:, None] * cost * col[None, :]


def balanced_assignment(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token gets ``top_k`` distinct experts; no expert more than ``ceil(T*k/E)``; highest probability first."""
    tokens, experts = probs.shape
    capacity = math.ceil(tokens * top_k / experts)
    order = torch.argsort(probs.flatten(), descending=True, stable=True).tolist()
    load = [0] * experts
    chosen: list[list[int]] = [[] for _ in range(tokens)]
    for flat in order:
        t, e = divmod(flat, experts)
        if len(chosen[t]) < top_k and load[e] < capacity:
            chosen[t].append(e)
            load[e] += 1
    for t in range(tokens):  # capacity * E >= T * k, so a free expert always remains
        for e in sorted(range(experts), key=lambda x: (load[x] >= capacity, -float(probs[t, x]))):
            if len(chosen[t]) == top_k:
                break
            if e not in chosen[t]:
                chosen[t].append(e)
                load[e] += 1
    return torch.tensor(chosen, dtype=torch.long, device=probs.device)


def aux_loss(logits: torch.Tensor, indices: torch.Tensor, coeff: float) -> torch.Tensor:
    """Switch-Transformer load balancing: ``coeff * E * sum_e f_e * P_e``.

    ``f_e``: the share of the T*k routing slots that went to expert e; ``P_e``: the mean router probability
    of e over the tokens. Equals 1 * coeff when routing is uniform.
    """
    tokens, experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.zeros(experts, dtype=torch.float32, device=logits.device)
    counts.index_add_(0, indices.flatten(), torch.ones(indices.numel(), device=logits.device))
    share = counts / indices.numel()
    return coeff * experts * torch.sum(share * probs.mean(dim=0))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean_t logsumexp(logits_t)^2``; keeps router logits small."""
    return coeff * torch.logsumexp(logits.float(), dim=-1).square().mean()
