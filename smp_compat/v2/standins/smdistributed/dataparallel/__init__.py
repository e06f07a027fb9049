"""smp_compat's stand-in for SMDDP (``smdistributed.dataparallel``), served only where it is not installed."""

from __future__ import annotations

__all__: list[str] = []
