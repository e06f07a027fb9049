"""Opt-in per-step timeline of the pipeline engine: who computed, sent, received or waited, when.

Turn it on with ``smp_compat.timeline.enable()`` (or ``SMP_TIMELINE=1``) before the steps you want
to see. Each rank records its own spans; ``gather_chrome_trace`` collects them on rank 0 as a
Chrome-trace JSON (open in chrome://tracing or Perfetto), and ``idle_fraction`` says how much of the
step the compute thread spent waiting, to compare with the ideal bubble (p-1)/(m+p-1).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Span", "Timeline", "enable", "disable", "current", "ideal_idle_fraction", "gather_chrome_trace"]


@dataclass(frozen=True)
class Span:
    """One interval on one track of one rank."""

    track: str  # "compute", "send->1", "recv<-0"
    name: str  # task or message name
    category: str  # "forward", "backward", "idle", "comm", "step"
    start: float
    end: float
    microbatch: int | None = None


@dataclass
class Timeline:
    """The spans one rank recorded, and the step intervals they belong to."""

    rank: int = 0
    spans: list[Span] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def add_step(self, start: float, end: float) -> None:
        with self._lock:
            self.steps.append((start, end))

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()
            self.steps.clear()

    def idle_fraction(self, last: int | None = None) -> float:
        """Idle time of the compute thread over step time, for the last ``last`` steps (all by default)."""
        steps = self.steps[-last:] if last else self.steps
        total = sum(end - start for start, end in steps)
        if total <= 0:
            return 0.0
        idle = 0.0
        for span in self.spans:
            if span.category == "idle" and span.track == "compute":
                idle += sum(_overlap(span.start, span.end, s, e) for s, e in steps)
        return idle / total

    def chrome_events(self) -> list[dict[str, Any]]:
        events = []
        for span in self.spans:
            args = {} if span.microbatch is None else {"microbatch": span.microbatch}
            events.append({
                "name": span.name, "cat": span.category, "ph": "X", "pid": self.rank, "tid": span.track,
                "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6, "args": args,
            })  # fmt: skip
        for i, (start, end) in enumerate(self.steps):
            events.append({"name": f"step {i}", "cat": "step", "ph": "X", "pid": self.rank, "tid": "step",
                           "ts": start * 1e6, "dur": (end - start) * 1e6, "args": {}})  # fmt: skip
        return events


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def ideal_idle_fraction(pp: int, microbatches: int) -> float:
    """The bubble of a fill-drain or 1F1B schedule with equal stages: (p-1)/(m+p-1)."""
    return (pp - 1) / (microbatches + pp - 1)


_current: Timeline | None = Timeline() if os.environ.get("SMP_TIMELINE") == "1" else None


def enable(rank: int | None = None) -> Timeline:
    """Start recording (a fresh timeline) and return it."""
    global _current
    if rank is None:
        from smp_compat.globalstate import state

        rank = state.rank
    _current = Timeline(rank=rank)
    return _current


def disable() -> None:
    global _current
    _current = None


def current() -> Timeline | None:
    """The timeline being recorded, or None (the engine checks this before every span)."""
    return _current


def now() -> float:
    return time.perf_counter()


def gather_chrome_trace(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]] | None:
    """Collective over the world: rank 0 gets every rank's events (and writes ``path`` if given)."""
    from smp_compat.comm import WORLD, allgather

    timeline = _current or Timeline()
    everything = allgather(timeline.chrome_events(), WORLD)
    from smp_compat.globalstate import state

    if state.rank != 0:
        return None
    events = [event for rank_events in everything for event in rank_events]
    if path is not None:
        Path(path).write_text(json.dumps({"traceEvents": events}))
    return events
