"""Stand-in for ``transformer_engine.common``: only ``recipe``."""

from __future__ import annotations

from smp_compat.v2.standins.transformer_engine.common import recipe

__all__ = ["recipe"]
