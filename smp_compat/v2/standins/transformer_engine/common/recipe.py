"""Stand-in for ``transformer_engine.common.recipe``: the fp8 recipe classes scripts build (kept, never applied)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from smp_compat.v2.standins import absent_names

__all__ = ["DelayedScaling", "Format"]


class Format(enum.Enum):
    """The fp8 formats: E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward, E5M2 backward)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    """TE's delayed-scaling recipe with its documented defaults; the stand-in's fp8_autocast does not use it."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    interval: int = 1


__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
