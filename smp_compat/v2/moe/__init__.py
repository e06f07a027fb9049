"""``torch.sagemaker.moe``: importable; mixture-of-experts models under ``transform`` come with issue 35."""

from __future__ import annotations

__all__: list[str] = []
