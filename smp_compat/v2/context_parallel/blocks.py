"""Blockwise causal attention with a log-sum-exp, forward and backward, in plain torch (CPU and GPU).

Queries come "grouped": ``(B, Hkv, G * Lq, D)`` where the ``G`` query heads that share one key/value head (GQA)
are stacked along the rows, so keys and values keep their ``Hkv`` heads and their gradients sum over the group
without a copy per query head. A block is one query chunk against one stretch of keys; its result is the
softmax-normalized output plus the row log-sum-exp, and blocks merge exactly (``merge``). The backward of a
block needs the final (merged) output and log-sum-exp of its rows, as FlashAttention's does; nothing but the
inputs, the output and the log-sum-exp is kept between forward and backward.
"""

from __future__ import annotations

import torch

__all__ = ["BlockResult", "block_backward", "block_forward", "causal_mask", "group_queries", "merge", "ungroup"]

BlockResult = tuple[torch.Tensor, torch.Tensor]  # (output fp32 (B, Hkv, R, D), lse fp32 (B, Hkv, R))


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, Hkv, G * L, D): query head ``h`` uses key/value head ``h // G`` (Hugging Face's order)."""
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * n, d)


def ungroup(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`group_queries`."""
    b, _, rows, d = x.shape
    return x.reshape(b, heads, rows * x.shape[1] // heads, d)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, groups: int) -> torch.Tensor:
    """(G * Lq, Lk) booleans: row attends column when the key's position is not after the query's."""
    return (k_pos[None, :] <= q_pos[:, None]).repeat(groups, 1)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _fused(q: torch.Tensor) -> bool:
    """PyTorch's CPU flash-attention kernels (which return the log-sum-exp and take the final output and
    log-sum-exp in the backward) serve fp32/bf16/fp16 on the CPU; elsewhere the plain math below runs."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The kernels' mask form: additive, in the queries' dtype (0 visible, -inf hidden)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None) -> BlockResult:  # fmt: skip
    """Attention of grouped queries ``q`` over ``k``/``v`` (``mask``: None = every key visible to every row)."""
    if _fused(q):
        out, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=_bias(mask, q.dtype), scale=scale)
        return out.float(), lse.float()
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.float()), lse


def merge(acc: BlockResult | None, new: BlockResult) -> BlockResult:
    """Combine two blocks' results over disjoint keys into the result over their union."""
    if acc is None:
        return new
    (out_a, lse_a), (out_b, lse_b) = acc, new
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse


def block_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Gradients (fp32) of one block for q, k, v, given the rows' final ``out``, ``lse``, ``dout`` and
    ``delta = rowsum(dout * out)`` (the softmax backward's correction, the same for every block of a row)."""
    if _fused(q):
        grads = _CPU_FLASH_BACKWARD(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, False,
                                    attn_mask=_bias(mask, q.dtype), scale=scale)  # fmt: skip
        return grads[0].float(), grads[1].float(), grads[2].float()
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.float().transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, dk, dv
