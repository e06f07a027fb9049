"""The head/tail split AWS's scripts apply before the forward: which tokens a context-parallel rank holds.

``get_batch_for_cp_rank`` cuts the sequence into ``2 * cp`` equal chunks and gives rank ``c`` chunks ``c`` and
``2 * cp - 1 - c``, concatenated (each rank then has the same causal work). Everything that must know where the
local tokens sit in the whole sequence (rotary positions, the causal mask, the label shift) asks this module.
"""

from __future__ import annotations

import torch

from smp_compat.errors import SMPConfigError

__all__ = ["chunk_indices", "chunk_owner", "local_positions", "split_for_cp_rank"]


def chunk_indices(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices (head, tail) that ``cp_rank`` holds, in its local order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_owner(cp: int, chunk: int) -> tuple[int, int]:
    """(rank, slot) of global chunk ``chunk``: slot 0 is the rank's head chunk, 1 its tail chunk."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def chunk_length(local_len: int) -> int:
    """Tokens per chunk; the local sequence must hold two equal chunks."""
    if local_len % 2:
        raise SMPConfigError(
            f"context parallelism: each rank's sequence holds two equal chunks (head and tail), so its length must "
            f"be even; got {local_len}. Make max_context_width a multiple of 2 x context_parallel_degree."
        )
    return local_len // 2


def local_positions(cp: int, cp_rank: int, local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The true positions (in the unsplit sequence) of the ``local_len`` tokens ``cp_rank`` holds."""
    n = chunk_length(local_len)
    head, tail = chunk_indices(cp, cp_rank)
    return torch.cat([torch.arange(head * n, (head + 1) * n, device=device),
                      torch.arange(tail * n, (tail + 1) * n, device=device)])  # fmt: skip


def split_for_cp_rank(tensor: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """What the scripts' ``get_batch_for_cp_rank`` hands ``cp_rank``: its head and tail chunks along ``dim``."""
    size = tensor.shape[dim]
    if size % (2 * cp):
        raise SMPConfigError(f"context parallelism: sequence length {size} is not divisible by 2 x cp = {2 * cp}.")
    chunks = tensor.chunk(2 * cp, dim=dim)
    head, tail = chunk_indices(cp, cp_rank)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)
