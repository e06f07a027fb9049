"""Core binding: each local rank pinned to its own share of the cores (``smp-compat run --bind-cores``).

Unbound, the OS moves a rank's threads between cores, and a thread it wakes may land on a core that
another rank keeps busy; the two then share that core until the next load balance. On the 2-core
development machine that made compute spans 10-40% longer (docs/benchmarks.md), and it costs an engine
that hands work between threads (smp_compat's tasks) more than a single-threaded schedule. The launcher
only sets a variable; each process binds itself in ``smp.init``, when its local rank is known.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

__all__ = ["BIND_ENV", "bind_from_environment", "bind_process", "core_share"]

BIND_ENV = "SMP_COMPAT_BIND_CORES"
"""Set to ``1`` (``smp-compat run --bind-cores`` does) to pin each local rank to its share of the cores."""

log = logging.getLogger("smp_compat")


def core_share(cores: Sequence[int], local_rank: int, local_size: int) -> set[int]:
    """Local rank ``local_rank``'s contiguous slice of ``cores``; ranks share cores only when there are fewer.

    With 8 cores and 2 ranks: ``{0..3}`` and ``{4..7}``; with 10 cores and 4 ranks the first two ranks get
    3 cores, the others 2; with 2 cores and 4 ranks, ranks 0 and 2 share core 0.
    """
    ordered = sorted(cores)
    if not ordered or local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError(f"no core share for local rank {local_rank} of {local_size} on cores {ordered}")
    if len(ordered) < local_size:
        return {ordered[local_rank % len(ordered)]}
    base, extra = divmod(len(ordered), local_size)
    start = local_rank * base + min(local_rank, extra)
    return set(ordered[start : start + base + (1 if local_rank < extra else 0)])


def bind_process(cores: set[int]) -> None:
    """Pin every thread of this process (running ones included, e.g. torch's OpenMP pool) to ``cores``.

    Threads started later inherit the mask of the thread that starts them.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def bind_from_environment(local_rank: int, local_size: int, environ: Mapping[str, str] | None = None) -> set[int] | None:
    """Bind this process to its share of the cores it may use when ``SMP_COMPAT_BIND_CORES=1``; the cores, or None."""
    env = os.environ if environ is None else environ
    if env.get(BIND_ENV, "").strip() not in ("1", "true", "True"):
        return None
    if not hasattr(os, "sched_setaffinity"):
        log.warning("%s is set but this platform cannot bind threads to cores; running unbound", BIND_ENV)
        return None
    cores = core_share(sorted(os.sched_getaffinity(0)), local_rank, local_size)
    bind_process(cores)
    log.info("local rank %d bound to cores %s", local_rank, sorted(cores))
    return cores
