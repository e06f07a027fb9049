"""A bounded CPU hog for the load tests: busy processes that keep every core of the machine loaded.

Each hog is its own interpreter (not a fork of the test process, so it shares none of its state) that spins
until its own deadline: if the test that started it dies, the hog still ends by itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cpu_hog"]

_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def cpu_hog(processes: int | None = None, seconds: float = 600.0) -> Iterator[list[subprocess.Popen]]:
    """Run ``processes`` busy loops (default: two per core) while the block runs, for at most ``seconds``."""
    count = processes or 2 * (os.cpu_count() or 1)
    hogs = [subprocess.Popen([sys.executable, "-c", _SPIN.format(seconds=seconds)]) for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
