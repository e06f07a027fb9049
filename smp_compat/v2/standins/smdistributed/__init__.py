"""smp_compat's stand-in for SageMaker's ``smdistributed``, served only where no ``smdistributed`` exists
(``smp-compat run`` puts the SMP v1 shim's on the path; a SageMaker container has the real one)."""

from __future__ import annotations

from smp_compat.v2.standins import absent_names


__all__: list[str] = []

__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
