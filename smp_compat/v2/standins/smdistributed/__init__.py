"""smp_compat's stand-in for SageMaker's ``smdistributed``, served only where no ``smdistributed`` exists
(``smp-compat run`` puts the SMP v1 shim's on the path; a SageMaker container has the real one)."""

from __future__ import annotations

__all__: list[str] = []
