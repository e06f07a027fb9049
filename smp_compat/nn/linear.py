"""``smp.nn.DistributedLinear`` (row-parallel) and ``smp.nn.DistributedEmbedding`` (split over embedding_dim)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.nn import comm
from smp_compat.nn.module import DistributedModule, divide, shard

__all__ = ["DistributedLinear", "DistributedEmbedding"]


class DistributedLinear(DistributedModule):
    """``nn.Linear(in_features, out_features)`` with ``in_features`` split over the tp group (sizes are global).

    The weight is initialized as ``nn.Linear`` would, full size, then this rank keeps its column block;
    the bias is replicated and added once, after the partial products are summed.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.local_in_features = divide(in_features, "DistributedLinear in_features")
        full = nn.Linear(in_features, out_features)
        self.weight = shard(full.weight.data, dim=1)
        self.bias = nn.Parameter(full.bias.data.clone())

    def reset_parameters(self) -> None:
        """Delayed initialization: a whole ``nn.Linear`` from the global RNG, then this rank's columns."""
        full = nn.Linear(self.in_features, self.out_features)
        with torch.no_grad():
            self.weight.copy_(shard(full.weight.data, dim=1))
            self.bias.copy_(full.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = comm.enter_region(x)
        start = comm.tp_index() * self.local_in_features
        part = F.linear(x[..., start : start + self.local_in_features], self.weight)
        return comm.exit_region(part) + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp_local_in={self.local_in_features}"


class DistributedEmbedding(DistributedModule):
    """``nn.Embedding`` with ``embedding_dim`` split over the tp group (SMP: "only supports splitting across
    the embedding_dim"); the output is the full ``[..., embedding_dim]`` for this rank's own ids."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        initializer_range: float = 0.02,
        _skip_allgather: bool = False,
        _skip_scatter_and_merge: bool = False,
    ) -> None:
        super().__init__()
        options = {"max_norm": max_norm, "sparse": sparse or None, "_skip_allgather": _skip_allgather or None,
                   "_skip_scatter_and_merge": _skip_scatter_and_merge or None}  # fmt: skip
        for name, value in options.items():
            if value is not None:
                raise SMPUnsupportedError(f"smp.nn.DistributedEmbedding({name}={value!r})")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.scale_grad_by_freq = padding_idx, scale_grad_by_freq
        self.local_embedding_dim = divide(embedding_dim, "DistributedEmbedding embedding_dim")
        self.initializer_range = initializer_range
        if _weight is None:
            _weight = torch.empty(num_embeddings, embedding_dim).normal_(0.0, initializer_range)
            if padding_idx is not None:
                _weight[padding_idx].zero_()
        self.weight = shard(_weight, dim=1)

    def reset_parameters(self) -> None:
        """Delayed initialization: the whole table from the global RNG, then this rank's columns."""
        full = torch.empty(self.num_embeddings, self.embedding_dim).normal_(0.0, self.initializer_range)
        if self.padding_idx is not None:
            full[self.padding_idx].zero_()
        with torch.no_grad():
            self.weight.copy_(shard(full, dim=1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if comm.prescaled():
            return comm.gather_last_dim(self._lookup(ids))
        return comm.own_batch_all_columns(self._lookup(comm.gather_batch_nograd(ids)))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx, None, 2.0, self.scale_grad_by_freq, False)
