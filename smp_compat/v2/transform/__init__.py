"""``torch.sagemaker.transform`` (the function; ``torch.sagemaker.transform`` resolves to it, not to this package)."""

from __future__ import annotations

from smp_compat.v2.transform.api import transform

__all__ = ["transform"]
