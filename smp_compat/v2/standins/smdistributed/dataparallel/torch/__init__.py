"""Stand-in for ``smdistributed.dataparallel.torch``: only ``torch_smddp``."""

from __future__ import annotations

from smp_compat.v2.standins import absent_names


__all__: list[str] = []

__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
