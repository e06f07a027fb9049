"""Stand-in for ``transformer_engine.common``: only ``recipe``."""

from __future__ import annotations

from smp_compat.v2.standins import absent_names
from smp_compat.v2.standins.transformer_engine.common import recipe

__all__ = ["recipe"]

__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
