"""Autograd collectives over the tensor-parallel group, and the two batch layouts of SMP's distributed modules.

A distributed module computes its sharded part inside a *region*:

* default batch (``prescaled_batch`` False): every tp rank brings its own samples; entering the region
  all-gathers the tp group's batch along dim 0 (backward: reduce-scatter, summing the peers' partial
  gradients), leaving it reduce-scatters the partial outputs (sum) so each rank gets its own samples back.
* prescaled batch: the tp group shares one batch; entering is the identity (backward: all-reduce), leaving
  all-reduces the partial outputs (backward: identity). This is Megatron's copy-to / reduce-from pair.

Outside a process group, or at tp = 1, every function here is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from smp_compat.globalstate import state

__all__ = [
    "tp_group", "tp_world", "tp_index", "prescaled", "enter_region", "exit_region",
    "gather_batch", "scatter_batch", "copy_to_tp", "reduce_from_tp", "gather_last_dim", "own_batch_all_columns",
]  # fmt: skip


def tp_world() -> int:
    """The tensor-parallel degree (1 before ``smp.init``)."""
    return state.topology.tp_size if state.initialized else 1


def tp_index() -> int:
    """This rank's position in its tp group (0 before ``smp.init``)."""
    return state.topology.coords(state.rank).tp_rank if state.initialized else 0


def tp_group() -> Any:
    return state.groups.get("tp")


def prescaled() -> bool:
    """Whether the tp group shares one batch (``prescaled_batch``)."""
    return bool(state.initialized and state.cfg.prescaled_batch)


# torch >= 2.13 renamed the tensor-form collectives; older versions only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_dim0(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((tp_world() * x.shape[0], *x.shape[1:]))
    _ALL_GATHER(out, x, group=tp_group())
    return out


def _reduce_scatter_dim0(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    n = tp_world()
    if x.shape[0] % n:
        raise RuntimeError(f"reduce-scatter over the tp group needs dim 0 ({x.shape[0]}) divisible by {n}")
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    _REDUCE_SCATTER(out, x, group=tp_group())
    return out


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone().contiguous()
    dist.all_reduce(x, group=tp_group())
    return x


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_gather_dim0(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter_dim0(grad)


class _ScatterBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _reduce_scatter_dim0(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _all_gather_dim0(grad)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _GatherLastDim(torch.autograd.Function):
    """Forward: concatenate every rank's column block; backward: keep this rank's block (grads are replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(tp_world())]
        dist.all_gather(parts, x.contiguous(), group=tp_group())
        ctx.width = x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        start = tp_index() * ctx.width
        return grad[..., start : start + ctx.width].contiguous()


class _OwnBatchAllColumns(torch.autograd.Function):
    """[tp*B, ..., W/tp] (all samples, own columns) -> [B, ..., W] (own samples, all columns): an all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        n, me = tp_world(), tp_index()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=tp_group())
        b = x.shape[0] // n
        return torch.cat([p[me * b : (me + 1) * b] for p in parts], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        n, me = tp_world(), tp_index()
        parts = [torch.empty_like(grad) for _ in range(n)]
        dist.all_gather(parts, grad.contiguous(), group=tp_group())
        width = grad.shape[-1] // n
        return torch.cat([p[..., me * width : (me + 1) * width] for p in parts], dim=0)


def _active() -> bool:
    return tp_world() > 1 and tp_group() is not None


def gather_batch(x: torch.Tensor) -> torch.Tensor:
    return _GatherBatch.apply(x) if _active() else x


def scatter_batch(x: torch.Tensor) -> torch.Tensor:
    return _ScatterBatch.apply(x) if _active() else x


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    return _CopyToTP.apply(x) if _active() else x


def reduce_from_tp(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTP.apply(x) if _active() else x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    return _GatherLastDim.apply(x) if _active() else x


def own_batch_all_columns(x: torch.Tensor) -> torch.Tensor:
    return _OwnBatchAllColumns.apply(x) if _active() else x


def enter_region(x: torch.Tensor) -> torch.Tensor:
    """Input of a sharded computation: the tp group's batch (default) or the shared batch (prescaled)."""
    return copy_to_tp(x) if prescaled() else gather_batch(x)


def exit_region(x: torch.Tensor) -> torch.Tensor:
    """Sum the shards' partial outputs and hand each rank its own samples back."""
    return reduce_from_tp(x) if prescaled() else scatter_batch(x)


def gather_mask(mask: torch.Tensor | None, batch: int, s_q: int, s_k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """An additive attention mask following the batch into the region. Peers may differ in whether they have a
    mask at all (Hugging Face drops it when a batch has no padding) or in its broadcast shape, so under the
    default batch layout every rank sends a full ``[B, 1, S_q, S_k]`` one."""
    if prescaled() or not _active():
        return mask
    device = mask.device if mask is not None else state.device
    full = torch.zeros(batch, 1, s_q, s_k, dtype=dtype, device=device)
    if mask is not None:
        full = full + mask.to(dtype)
    return _all_gather_dim0(full)


def gather_batch_nograd(x: torch.Tensor | None) -> torch.Tensor | None:
    """A non-differentiable input (ids, masks) following the batch into the region."""
    if x is None or prescaled() or not _active():
        return x
    return _all_gather_dim0(x)
