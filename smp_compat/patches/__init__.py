"""SMP's ``smdistributed.modelparallel.torch.patches`` import path (scripts import checkpointing from it)."""

from __future__ import annotations

__all__: list[str] = []
