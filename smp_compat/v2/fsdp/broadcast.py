"""``sync_module_states=True``: every rank takes the source rank's parameters and buffers.

FSDP1 broadcasts from rank 0 of its group and refuses CPU modules; the fine-tuning path of the scripts
loads the pretrained weights on rank 0 only and relies on it. Here the data-parallel copy comes from
data-parallel rank 0 (over the "shard" then the "rep" mesh dimension, CPU or GPU), and tensors that are
not tensor-parallel pieces (embeddings, norms, the head) first come from tensor-parallel rank 0, so they
match across the tensor-parallel group too (tsm.transform distributes the pieces from rank 0 itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from smp_compat.v2.fsdp.context import Context
from smp_compat.v2.fsdp.layout import FsdpLayout

__all__ = ["sync_from_source"]


def sync_from_source(ctx: Context, layout: FsdpLayout, modules: list[nn.Module]) -> None:
    """Overwrite the direct parameters and buffers of ``modules`` with the source rank's values."""
    tensors = {id(t): t for m in modules for t in [*m._parameters.values(), *m._buffers.values()] if t is not None}
    plain = [t.data for t in tensors.values() if not isinstance(t, DTensor)]
    pieces = [t.to_local() for t in tensors.values() if isinstance(t, DTensor)]
    if ctx.tp_size > 1 and plain:
        _broadcast(plain, ctx.mesh.get_group("tp"))
    for dim in (1, 0):  # shard (or shard x cp), then rep
        if layout.mesh.size(dim) > 1:
            _broadcast(plain + pieces, layout.mesh.get_group(dim))


def _broadcast(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """One broadcast per dtype from the group's rank 0, packed into a flat buffer."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, group=group, group_src=0)
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
