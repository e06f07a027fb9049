"""smp_compat's stand-in for ``smdistributed.modelparallel``; ``.torch`` is smp_compat itself."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "1.15.0"
"""The SMP v1 API level smp_compat follows (kept equal to ``smp_compat.shim.SMP_API_VERSION`` by a test).

Hugging Face's Trainer imports it to decide which SMP features exist; importing smp_compat here would
start SMP's auto-init too early, hence a literal.
"""
