"""A real Transformer Engine on a GPU without fp8 (A100: compute capability 8.0 < 8.9): ``fp8_autocast(enabled=True)``
runs disabled, announced once, instead of raising. Three of AWS's p4d notebooks leave ``--fp8 1`` on."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from smp_compat.v2.standins import announce

__all__ = ["guard_real_fp8_autocast"]

_MARK = "_smp_compat_fp8_guard"


def guard_real_fp8_autocast() -> bool:
    """Wrap the real ``transformer_engine.pytorch.fp8_autocast`` where fp8 cannot run; True when wrapped."""
    te = sys.modules.get("transformer_engine.pytorch")
    if te is None or te.__name__.startswith("smp_compat") or getattr(te.fp8_autocast, _MARK, False):
        return False  # not imported, our stand-in, or done
    try:
        from transformer_engine.pytorch.fp8 import check_fp8_support
    except ImportError:
        return False
    supported, reason = check_fp8_support()
    if supported:
        return False
    original = te.fp8_autocast

    @contextlib.contextmanager
    def fp8_autocast(enabled: bool = True, *args: Any, **kwargs: Any) -> Iterator[None]:
        if enabled:
            announce("fp8", f"fp8_autocast(enabled=True) on a GPU without fp8 ({reason}): running with fp8 off.")
        with original(False, *args, **kwargs):
            yield

    setattr(fp8_autocast, _MARK, True)
    te.fp8_autocast = fp8_autocast
    return True
