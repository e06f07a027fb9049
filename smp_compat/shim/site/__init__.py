"""Not a module to import: the directory ``smp-compat run`` puts on PYTHONPATH (see ``smp_compat.shim``).

This file only makes packaging tools ship the directory with smp_compat.
"""

from __future__ import annotations

__all__: list[str] = []
