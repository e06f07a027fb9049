"""Stand-in for ``smdistributed.dataparallel.torch``: only ``torch_smddp``."""

from __future__ import annotations

__all__: list[str] = []
