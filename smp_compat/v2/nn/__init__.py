"""``torch.sagemaker.nn``: SMP's flash-attention modules, importable for the scripts' dead branches only."""

from __future__ import annotations

__all__: list[str] = []
