"""Sharded data parallelism (SMP's ``sharded_data_parallel_degree``) on PyTorch's FSDP2.

SMP v1 sharded parameters, gradients and optimizer state over groups of ``sharded_data_parallel_degree``
data-parallel ranks (MiCS / ZeRO-3 style), replicating the state across groups. Here the same layout is
FSDP2's ``fully_shard`` over a DeviceMesh: 1-D ``("sdp_shard",)`` when sdp == dp, else HSDP over
``("sdp_rep", "sdp_shard")``. SMP's semantics sit on top: sharding at ``smp.DistributedModel(...)``,
clipping inside ``optimizer.step()``, sharded checkpoints in ``<tag>_partial/`` (DCP).
"""

from __future__ import annotations

from smp_compat.globalstate import state

__all__ = ["enabled"]


def enabled() -> bool:
    """True when the job shards model state (``sharded_data_parallel_degree`` > 1)."""
    return bool(state.initialized and state.cfg.sharded_data_parallel_degree > 1)
