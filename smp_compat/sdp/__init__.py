"""Sharded data parallelism (SMP's ``sharded_data_parallel_degree``) on PyTorch's FSDP2.

SMP v1 sharded parameters, gradients and optimizer state over groups of ``sharded_data_parallel_degree``
data-parallel ranks (MiCS / ZeRO-3 style), replicating the state across groups. Here the same layout is
FSDP2's ``fully_shard`` over a DeviceMesh: 1-D ``("sdp_shard",)`` when sdp == dp, else HSDP over
``("sdp_rep", "sdp_shard")``. SMP's semantics sit on top: sharding at ``smp.DistributedModel(...)``,
clipping inside ``optimizer.step()``, sharded checkpoints in ``<tag>_partial/`` (DCP).
"""

from __future__ import annotations

import torch

from smp_compat.errors import SMPUnsupportedError
from smp_compat.globalstate import state

__all__ = ["enabled", "require_fsdp2"]

TORCH_FLOOR = "2.6"
"""The oldest torch with the APIs below public (pyproject.toml's floor; docs/versions.md has its run)."""


def require_fsdp2() -> None:
    """SMPUnsupportedError, naming the feature and the version, where torch lacks FSDP2 (``fully_shard``,
    ``MixedPrecisionPolicy``: public from torch 2.6) or DTensor (2.5); rather than an ImportError from
    deep inside ``import smp_compat``."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as exc:
        raise SMPUnsupportedError(
            f"smp_compat needs torch >= {TORCH_FLOOR}: sharded data parallelism and tensor parallelism's sharded "
            f"state use FSDP2 (torch.distributed.fsdp.fully_shard, MixedPrecisionPolicy; public from torch 2.6) "
            f"and DTensor (torch.distributed.tensor; 2.5). This is torch {torch.__version__}: "
            f"pip install 'torch>={TORCH_FLOOR}'") from exc  # fmt: skip


require_fsdp2()


def enabled() -> bool:
    """True when the job shards model state (``sharded_data_parallel_degree`` > 1)."""
    return bool(state.initialized and state.cfg.sharded_data_parallel_degree > 1)
