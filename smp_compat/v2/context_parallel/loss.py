"""The causal-LM loss of a context-parallel rank, shifted in the whole sequence and normalized so that the mean
over the cp group equals the unsplit model's loss.

Hugging Face shifts labels inside the tokens it is given; on a cp rank that would pair the head chunk's last
token with the tail chunk's first. Here each token's target is the next token of the unsplit sequence: inside
a chunk the next label is local, and the first label of every chunk is exchanged over the cp group (one small
all-gather, which also sums the number of counted targets). Rank ``c`` returns
``cp * sum(its token losses) / N`` with ``N`` the targets of the whole sequence batch: the mean of these values
over the cp group (what the FSDP gradient average over the shard group, which holds the cp ranks, computes) is
exactly Hugging Face's mean loss of the unsplit batch, and so are the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from smp_compat.v2.context_parallel.chunks import chunk_indices, chunk_length, chunk_owner

__all__ = ["IGNORE_INDEX", "global_shift_loss"]

IGNORE_INDEX = -100  # Hugging Face's
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def global_shift_loss(logits: torch.Tensor, labels: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's share of the unsplit causal-LM loss (see the module docstring); collective over ``group``."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    labels = labels.to(logits.device)
    batch, n = labels.shape[0], chunk_length(labels.shape[1])
    chunks = labels.view(batch, 2, n)
    counted = (labels != IGNORE_INDEX).sum()
    if rank == 0:  # the sequence's first label is nobody's target
        counted = counted - (labels[:, 0] != IGNORE_INDEX).sum()
    mine = torch.cat([chunks[:, :, 0].reshape(-1), counted.view(1)])
    every = torch.empty(cp * mine.numel(), dtype=mine.dtype, device=mine.device)
    _all_gather(every, mine, group=group)
    every = every.view(cp, -1)
    targets = torch.cat([chunks[:, :, 1:], _next_firsts(every, cp, rank, batch).unsqueeze(-1)], dim=2)
    total = every[:, -1].sum().to(torch.float32)
    summed = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="sum")  # fmt: skip
    return summed * cp / total


def _next_firsts(every: torch.Tensor, cp: int, rank: int, batch: int) -> torch.Tensor:
    """(B, 2): the target of each local chunk's last token, the first label of the following global chunk."""
    firsts = every[:, :-1].view(cp, batch, 2)
    columns = []
    for chunk in chunk_indices(cp, rank):
        if chunk + 1 == 2 * cp:
            columns.append(torch.full((batch,), IGNORE_INDEX, dtype=every.dtype, device=every.device))
        else:
            owner, slot = chunk_owner(cp, chunk + 1)
            columns.append(firsts[owner, :, slot])
    return torch.stack(columns, dim=1)
