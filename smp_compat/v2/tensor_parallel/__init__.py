"""``torch.sagemaker.tensor_parallel``: the decoder-layer class the scripts' FSDP wrap policy looks for."""

from __future__ import annotations

__all__: list[str] = []
