"""``torch.sagemaker.utils.utils.timeit``: time a block and log it (AWS's scripts time model creation and FSDP)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from smp_compat.v2.logger import get_logger

__all__ = ["timeit"]


@contextlib.contextmanager
def timeit(enabled: bool = True, message: str = "block", rank: int | None = None) -> Iterator[None]:
    """Log ``message`` and the block's wall time when ``enabled`` and on rank 0 (or when no rank is given);
    pending CUDA work is waited for at both ends, so the time is the block's, not its launch's."""
    if not enabled:
        yield
        return
    _synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        _synchronize()
        if rank in (None, 0):
            get_logger().info("%s took %.3f s", message, time.perf_counter() - start)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
