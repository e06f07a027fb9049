"""``smdistributed.modelparallel.torch.patches.checkpoint``: SMP's activation-checkpointing functions."""

from __future__ import annotations

from smp_compat.memory.activation_checkpointing import checkpoint, checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential"]
