"""smp_compat's stand-in for SageMaker's ``smdistributed`` package (on sys.path only through smp_compat.shim).

Other ``smdistributed`` packages installed elsewhere (e.g. ``smdistributed.dataparallel``) stay importable.
"""

from __future__ import annotations

from pkgutil import extend_path

__all__: list[str] = []

__path__ = extend_path(__path__, __name__)
