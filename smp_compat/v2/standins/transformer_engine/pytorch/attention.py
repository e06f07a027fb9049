"""Stand-in for ``transformer_engine.pytorch.attention``: ``MultiheadAttention`` for ``isinstance`` checks.

No model built through smp_compat contains TE's attention, so those checks are False; building one asks for
TE's fused kernels, which the stand-in does not have.
"""

from __future__ import annotations

from typing import Any

import torch

from smp_compat.errors import SMPUnsupportedError
from smp_compat.v2.standins import absent_names

__all__ = ["MultiheadAttention"]


class MultiheadAttention(torch.nn.Module):
    """Transformer Engine's attention block: importable, not constructible without the real package."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise SMPUnsupportedError(
            "transformer_engine.pytorch.attention.MultiheadAttention needs the real Transformer Engine (a CUDA "
            "build), which is not installed; use the Hugging Face model's own attention."
        )


__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
