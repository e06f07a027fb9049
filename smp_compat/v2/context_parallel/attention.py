"""Causal attention over the whole sequence when each context-parallel rank holds two chunks of it.

Two communication patterns, SMP's ``cp_comm_type`` values, both exact and both written as autograd Functions
that keep only the local queries, keys, values, output and log-sum-exp for the backward (so activation memory
per rank falls with ``cp``):

* ``all_gather``: the keys and values of every rank are all-gathered in the forward (and again in the backward,
  instead of being kept); the key/value gradients go back to their owners by reduce-scatter.
* ``p2p`` (ring): key/value blocks travel around the cp ring, one block per step, the next transfer overlapping
  the current block's compute; the partial results merge by log-sum-exp. In the backward the key/value
  gradients travel with their blocks and reach their owner after a full turn.

Blocks that the causal mask hides entirely are skipped (chunk granularity), so each rank does the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from smp_compat.v2.context_parallel import blocks
from smp_compat.v2.context_parallel.chunks import chunk_indices, chunk_owner

__all__ = ["CpGroup", "context_parallel_attention"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CpGroup:
    """The context-parallel group as the attention needs it: size, this rank's index, ring neighbours."""

    group: dist.ProcessGroup
    size: int
    rank: int
    comm_type: str  # "p2p" or "all_gather"

    @classmethod
    def of(cls, group: dist.ProcessGroup, comm_type: str) -> CpGroup:
        return cls(group, dist.get_world_size(group), dist.get_rank(group), comm_type)

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places after this one on the ring."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                               cp: CpGroup) -> torch.Tensor:  # fmt: skip
    """Causal attention of the local queries (B, H, 2L, D) over the whole sequence's keys/values, whose local
    part is ``k``/``v`` (B, Hkv, 2L, D); returns (B, H, 2L, D) in ``q``'s dtype."""
    fn = _RingAttention if cp.comm_type == "p2p" else _AllGatherAttention
    return fn.apply(q, k, v, scale, cp)


def _slots(q: torch.Tensor, kv_heads: int) -> list[torch.Tensor]:
    """The two local query chunks, grouped (see blocks.group_queries)."""
    n = q.shape[2] // 2
    return [blocks.group_queries(q[:, :, i * n : (i + 1) * n], kv_heads) for i in (0, 1)]


def _diagonal_mask(n: int, groups: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(n, device=device)
    return blocks.causal_mask(pos, pos, groups)


def _join(parts: list[torch.Tensor], heads: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([blocks.ungroup(p, heads) for p in parts], dim=2).to(dtype)


# ---------------------------------------------------------------------------------------------- all-gather


def _order(cp: int, device: torch.device) -> torch.Tensor:
    """Index, into the gathered (rank, slot) chunk list, of each global chunk."""
    return torch.tensor([2 * r + s for r, s in (chunk_owner(cp, j) for j in range(2 * cp))], device=device)


def _gather_sorted(kv: torch.Tensor, cp: CpGroup) -> torch.Tensor:
    """(2, B, Hkv, 2L, D) local -> (2, B, Hkv, 2cp*L, D): every rank's keys/values in sequence order."""
    two, b, h, m, d = kv.shape
    n = m // 2
    out = torch.empty((cp.size * two, b, h, m, d), dtype=kv.dtype, device=kv.device)  # ranks along dim 0
    _all_gather(out, kv.contiguous(), group=cp.group)
    chunks = out.view(cp.size, two, b, h, 2, n, d).permute(0, 4, 1, 2, 3, 5, 6).reshape(2 * cp.size, two, b, h, n, d)
    ordered = chunks.index_select(0, _order(cp.size, kv.device))
    return ordered.permute(1, 2, 3, 0, 4, 5).reshape(two, b, h, 2 * cp.size * n, d)


def _scatter_sorted(grad: torch.Tensor, cp: CpGroup) -> torch.Tensor:
    """The inverse of :func:`_gather_sorted` for gradients: each rank gets the sum over ranks of its part."""
    two, b, h, total, d = grad.shape
    n = total // (2 * cp.size)
    ordered = grad.view(two, b, h, 2 * cp.size, n, d).permute(3, 0, 1, 2, 4, 5)
    chunks = torch.empty_like(ordered)
    chunks[_order(cp.size, grad.device)] = ordered
    per_rank = chunks.view(cp.size, 2, two, b, h, n, d).permute(0, 2, 3, 4, 1, 5, 6)
    per_rank = per_rank.reshape(cp.size, two, b, h, 2 * n, d)
    mine = torch.empty((two, b, h, 2 * n, d), dtype=grad.dtype, device=grad.device)
    _reduce_scatter(mine, per_rank.reshape(cp.size * two, b, h, 2 * n, d), group=cp.group)
    return mine


def _spans(cp: CpGroup, slot: int, n: int, diagonal: torch.Tensor) -> list[tuple[slice, torch.Tensor | None]]:
    """For a local query chunk: the stretches of the sorted keys it sees, each with its mask (None: all of it):
    every earlier chunk whole, then its own chunk causally."""
    chunk = chunk_indices(cp.size, cp.rank)[slot]
    spans: list[tuple[slice, torch.Tensor | None]] = [(slice(0, chunk * n), None)] if chunk else []
    return spans + [(slice(chunk * n, (chunk + 1) * n), diagonal)]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, cp):  # type: ignore[override]
        kv = _gather_sorted(torch.stack([k, v]), cp)
        groups, n = q.shape[1] // k.shape[1], q.shape[2] // 2
        diagonal = _diagonal_mask(n, groups, q.device)
        outs, lses = [], []
        for slot, qs in enumerate(_slots(q, k.shape[1])):
            acc: blocks.BlockResult | None = None
            for keys, mask in _spans(cp, slot, n, diagonal):
                acc = blocks.merge(acc, blocks.block_forward(qs, kv[0, :, :, keys], kv[1, :, :, keys], scale, mask))
            outs.append(acc[0])  # type: ignore[index]
            lses.append(acc[1])  # type: ignore[index]
        ctx.save_for_backward(q, k, v, torch.stack(outs), torch.stack(lses))
        ctx.scale, ctx.cp = scale, cp
        return _join(outs, q.shape[1], q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, outs, lses = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        kv = _gather_sorted(torch.stack([k, v]), cp)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        groups, n = q.shape[1] // k.shape[1], q.shape[2] // 2
        diagonal = _diagonal_mask(n, groups, q.device)
        dqs = []
        for slot, (qs, dos) in enumerate(zip(_slots(q, k.shape[1]), _slots(dout, k.shape[1]))):
            dos = dos.float()
            delta = (dos * outs[slot]).sum(-1)
            dq_sum = torch.zeros_like(outs[slot])
            for keys, mask in _spans(cp, slot, n, diagonal):
                dq, dk, dv = blocks.block_backward(qs, kv[0, :, :, keys], kv[1, :, :, keys], scale, mask,
                                                   outs[slot], lses[slot], dos, delta)  # fmt: skip
                dkv[0, :, :, keys] += dk
                dkv[1, :, :, keys] += dv
                dq_sum += dq
            dqs.append(dq_sum)
        mine = _scatter_sorted(dkv, cp)
        return _join(dqs, q.shape[1], q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None


# ---------------------------------------------------------------------------------------------- ring (p2p)


def _exchange(send: torch.Tensor, cp: CpGroup, tag: int) -> tuple[torch.Tensor, list[dist.Work]]:
    """Send ``send`` to the next rank on the ring and receive the previous rank's tensor of the same shape."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, cp.peer(1), cp.group, tag),
           dist.P2POp(dist.irecv, recv, cp.peer(-1), cp.group, tag)]  # fmt: skip
    return recv, dist.batch_isend_irecv(ops)


def _pairs(cp: CpGroup, step: int) -> list[tuple[int, int, bool]]:
    """(query slot, key slot, diagonal?) for the blocks the causal mask leaves visible when this rank holds
    the keys of ring step ``step`` (those of rank ``rank - step``)."""
    mine = chunk_indices(cp.size, cp.rank)
    theirs = chunk_indices(cp.size, (cp.rank - step) % cp.size)
    return [(qs, ks, mine[qs] == theirs[ks]) for qs in (0, 1) for ks in (0, 1) if theirs[ks] <= mine[qs]]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, cp):  # type: ignore[override]
        groups, n = q.shape[1] // k.shape[1], q.shape[2] // 2
        diagonal = _diagonal_mask(n, groups, q.device)
        slots = _slots(q, k.shape[1])
        acc: list[blocks.BlockResult | None] = [None, None]
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp.size):
            pending = _exchange(kv, cp, 0) if step < cp.size - 1 else None
            for qs, ks, diag in _pairs(cp, step):
                keys = slice(ks * n, (ks + 1) * n)
                block = blocks.block_forward(slots[qs], kv[0, :, :, keys], kv[1, :, :, keys], scale,
                                             diagonal if diag else None)  # fmt: skip
                acc[qs] = blocks.merge(acc[qs], block)
            if pending is not None:
                kv = _wait(pending)
        outs = torch.stack([a[0] for a in acc])  # type: ignore[index]
        lses = torch.stack([a[1] for a in acc])  # type: ignore[index]
        ctx.save_for_backward(q, k, v, outs, lses)
        ctx.scale, ctx.cp = scale, cp
        return _join(list(outs), q.shape[1], q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, outs, lses = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        groups, n = q.shape[1] // k.shape[1], q.shape[2] // 2
        diagonal = _diagonal_mask(n, groups, q.device)
        slots, douts = _slots(q, k.shape[1]), [d.float() for d in _slots(dout, k.shape[1])]
        deltas = [(douts[i] * outs[i]).sum(-1) for i in (0, 1)]
        dqs = [torch.zeros_like(outs[0]), torch.zeros_like(outs[1])]
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(cp.size):
            pending = _exchange(kv, cp, 0) if step < cp.size - 1 else None
            for qs, ks, diag in _pairs(cp, step):
                keys = slice(ks * n, (ks + 1) * n)
                dq, dk, dv = blocks.block_backward(slots[qs], kv[0, :, :, keys], kv[1, :, :, keys], scale,
                                                   diagonal if diag else None, outs[qs], lses[qs], douts[qs],
                                                   deltas[qs])  # fmt: skip
                dqs[qs] += dq
                dkv[0, :, :, keys] += dk
                dkv[1, :, :, keys] += dv
            # the key/value gradients follow their block; after cp hops they are back with their owner
            dkv = _wait(_exchange(dkv, cp, 1)) if cp.size > 1 else dkv
            if pending is not None:
                kv = _wait(pending)
        return _join(dqs, q.shape[1], q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _wait(pending: tuple[torch.Tensor, list[dist.Work]]) -> torch.Tensor:
    recv, works = pending
    for work in works:
        work.wait()
    return recv
