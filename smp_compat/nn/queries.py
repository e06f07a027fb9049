"""``DistributedModel``'s questions about tensor parallelism (SMP's API): which modules are distributed and
which parameters are tp shards. Shards are the "distributed" and "scaled batch" parameters at once: they see
their tp group's whole batch and are reduced over the RDP group (nn/grads.py); the rest over DP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from smp_compat.nn.module import is_shard
from smp_compat.nn.swap import distributed_modules

__all__ = ["TensorParallelQueries"]


class TensorParallelQueries:
    """A mixin of ``DistributedModel``: needs ``module`` and ``local_named_parameters``."""

    module: nn.Module

    if TYPE_CHECKING:

        def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def distributed_modules(self) -> list[nn.Module]:
        """Outermost smp.nn.DistributedModule instances (swapped in, or built by the user)."""
        if self.__dict__.get("_tp_modules_cache") is None:
            self.__dict__["_tp_modules_cache"] = distributed_modules(self.module)
        return list(self.__dict__["_tp_modules_cache"])

    def is_distributed_parameter(self, param: nn.Parameter) -> bool:
        return is_shard(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        return is_shard(buf)

    def is_scaled_batch_parameter(self, param: nn.Parameter) -> bool:
        """Shards see their tp group's whole batch (SMP: "operates on the scaled batch")."""
        return is_shard(param)

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        return is_shard(buf)

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters averaged over the DP group."""
        return ((n, p) for n, p in self.local_named_parameters() if not is_shard(p))

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters reduced over the RDP group (tensor-parallel shards)."""
        return ((n, p) for n, p in self.local_named_parameters() if is_shard(p))
