"""Token dispatch to the experts over the expert-parallel group: differentiable ``all_to_all_single``.

Every rank sorts its (token, expert) pairs by expert, tells each peer how many pairs it sends to each of
that peer's experts, and exchanges the token rows; the experts run on what they received; a second
exchange brings the outputs home in the same order. Backward is the same exchange with the splits swapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AllToAll", "exchange_counts"]


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group`` with row splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``counts`` [ep, local_experts]: rows sent to each peer's experts -> [ep, local_experts] rows received
    from each peer for this rank's experts."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
