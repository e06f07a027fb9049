"""``torch.sagemaker.utils``: the helper modules AWS's scripts and SMP's reference name."""

from __future__ import annotations

__all__: list[str] = []
