"""Stand-in for ``transformer_engine.pytorch.attention``: ``MultiheadAttention`` and ``DotProductAttention``, for
``isinstance`` checks and for reading class attributes at import.

No model built through smp_compat contains TE's attention, so those checks are False; HyperPod's training adapter
reads ``DotProductAttention.get_extra_state`` at import (its context-parallel patch). Building either asks for
TE's fused kernels, which the stand-in does not have.
"""

from __future__ import annotations

from typing import Any

import torch

from smp_compat.errors import SMPUnsupportedError
from smp_compat.v2.standins import absent_names

__all__ = ["DotProductAttention", "MultiheadAttention"]


class _NeedsRealTE(torch.nn.Module):
    """A Transformer Engine module class: importable, not constructible without the real package."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise SMPUnsupportedError(
            f"transformer_engine.pytorch.attention.{type(self).__name__} needs the real Transformer Engine (a CUDA "
            "build), which is not installed; use the Hugging Face model's own attention."
        )


class MultiheadAttention(_NeedsRealTE):
    """Transformer Engine's attention block."""


class DotProductAttention(_NeedsRealTE):
    """Transformer Engine's core attention (its context parallelism lives here)."""


__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
