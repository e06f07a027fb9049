"""Initialize tensor-parallel parameters whole, so their pieces fit together as one tensor.

A decoder layer that ``transform`` split on the meta device holds DTensor parameters. Initializing each rank's
piece in place draws the same random numbers on every tp rank (the ranks share a seed, as the scripts'
``set_seed`` makes them), so every piece was the same block: a q_proj whose two halves were equal, i.e. heads
duplicated across the tp group. (DTensor's own sharded random ops exist only on CUDA-like devices.) Here the
initializer sees whole tensors, drawn as one process would draw them, and each rank keeps its piece; a delayed
initialization at tp 2 therefore gives the very weights it gives at tp 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["whole_during_init"]


@contextlib.contextmanager
def whole_during_init(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside: ``module``'s own DTensor parameters are whole, uninitialized tensors on ``device``; on exit each
    becomes a DTensor again, holding this rank's piece of what was written into the whole one."""
    pieces = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, piece in pieces.items():
        whole = torch.empty(piece.shape, dtype=piece.dtype, device=device)
        module._parameters[name] = nn.Parameter(whole, requires_grad=piece.requires_grad)
    try:
        yield
    finally:
        for name, piece in pieces.items():
            whole = module._parameters[name]
            local = distribute_tensor(whole.detach(), piece.device_mesh, piece.placements, src_data_rank=None)
            module._parameters[name] = nn.Parameter(local, requires_grad=piece.requires_grad)
