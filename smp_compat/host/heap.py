"""Keep freed memory in the process heap (by default in a CPU pipeline), so steps stop page-faulting.

glibc gives the free top of each thread's heap back to the OS above a threshold, and serves blocks above
another threshold with fresh mappings; both adapt to the largest block freed so far. A pipeline rank runs
its microbatches on several threads, each with a heap of its own, and every step then gave pages back and
faulted them in again: 1,000-1,700 minor faults per step on pp rank 0 of the width-512 benchmark, ~4.7 us
each on the development VM, against ~100 for torch's single-threaded schedules (docs/benchmarks.md).
Fixed, high thresholds keep those pages for reuse. The price is resident memory: up to ``TRIM_BYTES`` of
freed memory may stay with each heap. ``smp.init`` applies it in CPU pipelines, where the engine's threads
cause the faults; ``SMP_COMPAT_TUNE_MALLOC`` decides for any job (``globalstate.tune_from_environment``).
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["TUNE_MALLOC_ENV", "TRIM_BYTES", "MMAP_BYTES", "keep_freed_memory"]

TUNE_MALLOC_ENV = "SMP_COMPAT_TUNE_MALLOC"
"""``1`` (``smp-compat run --tune-malloc``) keeps freed memory in the heap from ``smp.init`` on, ``0``
(``--no-tune-malloc``) leaves malloc alone; unset: tuned in CPU pipelines (``globalstate.tune_from_environment``)."""

TRIM_BYTES = 64 << 20
"""Free memory a heap keeps at its top before returning any to the OS."""

MMAP_BYTES = 32 << 20
"""Blocks at least this large get their own mapping (glibc's largest allowed threshold on 64-bit)."""

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def keep_freed_memory(trim_bytes: int = TRIM_BYTES, mmap_bytes: int = MMAP_BYTES) -> bool:
    """Fix glibc's trim and mmap thresholds for the whole process; False where glibc's malloc is not the one
    in use (another C library, or an allocator preloaded in its place, which keeps freed memory itself)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return False
    libc = ctypes.CDLL(None)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # mmap first: setting either fixes both (no more adapting), and trim above mmap keeps mapped-size blocks
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_bytes))

