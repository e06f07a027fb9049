"""``torch.sagemaker.moe``: SMP v2's mixture-of-experts layer and expert parallelism for Mixtral (ep.py: the layout)."""

from __future__ import annotations

__all__: list[str] = []
