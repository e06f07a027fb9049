"""Stand-in for ``megatron.core.dist_checkpointing`` (see smp_compat.v2.standins.megatron)."""

from __future__ import annotations

__all__: list[str] = []
