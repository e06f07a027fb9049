"""``smp-compat timeline``: draw a pipeline step from the engine's Chrome trace, in the terminal and as SVG/HTML.

Reads the trace ``smp_compat.timeline.gather_chrome_trace`` writes (optionally with an ``otherData`` block
giving pp, microbatches and the schedule, as ``examples/timeline_demo.py`` writes it), picks one step, and
draws each rank's compute track: forward and backward work by colour with microbatch numbers, time spent
waiting for other ranks, and the measured idle fraction next to the ideal bubble (p-1)/(m+p-1).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from smp_compat.cli.svg import render_html, render_svg
from smp_compat.errors import SMPConfigError
from smp_compat.timeline import ideal_idle_fraction

__all__ = [
    "Bar",
    "Lane",
    "Picture",
    "build_picture",
    "load_trace",
    "render_html",
    "render_svg",
    "render_terminal",
    "timeline_command",
]

_COMPUTE = "compute"
_CATEGORIES = ("forward", "backward", "idle")
_TERM_STYLE = {"forward": "bold white on blue", "backward": "bold black on dark_orange", "idle": "grey50"}


@dataclass(frozen=True)
class Bar:
    """One span of a rank's compute track, in seconds from the start of the picture."""

    start: float
    end: float
    category: str  # forward, backward, idle
    microbatch: int | None = None


@dataclass
class Lane:
    """One rank's row: its bars inside the step, and the step's own extent on that rank."""

    rank: int
    step_start: float
    step_end: float
    bars: list[Bar] = field(default_factory=list)

    def _time(self, category: str) -> float:
        return sum(b.end - b.start for b in self.bars if b.category == category)

    @property
    def duration(self) -> float:
        return max(self.step_end - self.step_start, 0.0)

    def fraction(self, category: str) -> float:
        """Share of this rank's step spent in ``category``."""
        return self._time(category) / self.duration if self.duration > 0 else 0.0

    @property
    def not_computing(self) -> float:
        """Everything but forward and backward work: waiting, plus the engine's own bookkeeping."""
        return 1.0 - self.fraction("forward") - self.fraction("backward")


@dataclass
class Picture:
    """One step of every rank, on a common clock, with what the ideal schedule would leave idle."""

    lanes: list[Lane]
    start: float
    end: float
    step_index: int
    steps_recorded: int
    pp: int
    microbatches: int
    pipeline: str = ""
    aligned: bool = False  # True: each rank drawn from its own step start (clocks not comparable)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def span(self) -> float:
        return max(self.end - self.start, 1e-9)

    @property
    def ideal(self) -> float:
        return ideal_idle_fraction(self.pp, self.microbatches)

    def title(self) -> str:
        schedule = f", {self.pipeline}" if self.pipeline else ""
        return (f"pp = {self.pp}, microbatches = {self.microbatches}{schedule}: step {self.step_index + 1} of "
                f"{self.steps_recorded} recorded, {self.span * 1e3:.1f} ms")  # fmt: skip

    def explanation(self) -> str:
        """What the ideal bubble assumes, under the numbers."""
        return (f"ideal bubble (p-1)/(m+p-1) = ({self.pp}-1)/({self.microbatches}+{self.pp}-1): equal stages, "
                "free communication; compare 'not computing'.")  # fmt: skip


# ---------------------------------------------------------------- reading


def load_trace(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(events, otherData) of a Chrome-trace JSON file (an object with traceEvents, or a bare event list)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SMPConfigError(f"Cannot read the trace {str(path)!r}: {exc}. Pass the JSON file the run wrote.") from None
    except json.JSONDecodeError as exc:
        raise SMPConfigError(
            f"The trace {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno}); pass the file written by "
            "smp_compat.timeline.gather_chrome_trace (e.g. examples/timeline_demo.py --trace FILE)."
        ) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    other = data.get("otherData", {}) if isinstance(data, dict) else {}
    if not isinstance(events, list):
        raise SMPConfigError(
            f"The trace {str(path)!r} has no traceEvents list (top-level keys: {sorted(data)[:8]}); pass the file "
            "written by smp_compat.timeline.gather_chrome_trace."
        )
    return events, other if isinstance(other, dict) else {}


def _by_rank(events: Iterable[dict[str, Any]]) -> tuple[dict[int, list[tuple[float, float]]], dict[int, list[dict]]]:
    """Step intervals (seconds) and compute-track events, per rank (``pid``)."""
    steps: dict[int, list[tuple[float, float]]] = {}
    compute: dict[int, list[dict]] = {}
    for event in events:
        if not isinstance(event, dict) or event.get("ph") != "X" or not isinstance(event.get("pid"), int):
            continue
        rank = event["pid"]
        if event.get("cat") == "step":
            start = float(event["ts"]) / 1e6
            steps.setdefault(rank, []).append((start, start + float(event["dur"]) / 1e6))
        elif event.get("tid") == _COMPUTE and event.get("cat") in _CATEGORIES:
            compute.setdefault(rank, []).append(event)
    for intervals in steps.values():
        intervals.sort()
    return steps, compute


def _lane(rank: int, step: tuple[float, float], events: list[dict], origin: float) -> Lane:
    """The rank's compute spans clipped to its step, relative to ``origin``."""
    lane = Lane(rank, step[0] - origin, step[1] - origin)
    for event in events:
        start = float(event["ts"]) / 1e6
        end = start + float(event["dur"]) / 1e6
        start, end = max(start, step[0]), min(end, step[1])
        if end > start:
            mb = (event.get("args") or {}).get("microbatch")
            lane.bars.append(Bar(start - origin, end - origin, event["cat"], mb if isinstance(mb, int) else None))
    lane.bars.sort(key=lambda b: b.start)
    return lane


def build_picture(
    events: list[dict[str, Any]],
    other: dict[str, Any] | None = None,
    step: int = -1,
    pp: int | None = None,
    microbatches: int | None = None,
) -> Picture:
    """Pick step ``step`` (an index into the recorded steps; negative counts from the end) on every rank.

    ``pp`` and ``microbatches`` default to the trace's otherData, else to the number of ranks and of
    distinct microbatch numbers seen.
    """
    other = other or {}
    steps, compute = _by_rank(events)
    if not steps:
        raise SMPConfigError(
            "The trace holds no step spans, so there is no step to draw. Record at least one @smp.step call with "
            "pipeline_parallel_degree > 1 while smp_compat.timeline is enabled (see examples/timeline_demo.py)."
        )
    count = min(len(v) for v in steps.values())
    if not -count <= step < count:
        raise SMPConfigError(
            f"--step {step} is out of range: every rank recorded {count} step(s); pass 0 .. {count - 1} "
            "(or a negative index counting from the last)."
        )
    index = step % count
    chosen = {rank: intervals[index] for rank, intervals in sorted(steps.items())}
    aligned = _clocks_differ(list(chosen.values()))
    origin = min(start for start, _ in chosen.values())
    lanes = [
        _lane(rank, interval, compute.get(rank, []), interval[0] if aligned else origin)
        for rank, interval in chosen.items()
    ]
    seen_mbs = {b.microbatch for lane in lanes for b in lane.bars if b.microbatch is not None}
    return Picture(
        lanes=lanes,
        start=0.0,
        end=max(lane.step_end for lane in lanes),
        step_index=index,
        steps_recorded=count,
        pp=int(pp or other.get("pp") or len(lanes)),
        microbatches=int(microbatches or other.get("microbatches") or max(len(seen_mbs), 1)),
        pipeline=str(other.get("pipeline", "")),
        aligned=aligned,
        meta=other,
    )


def _clocks_differ(intervals: list[tuple[float, float]]) -> bool:
    """Ranks on one host share the monotonic clock and their steps overlap; otherwise align step starts."""
    latest_start = max(start for start, _ in intervals)
    earliest_end = min(end for _, end in intervals)
    return latest_start > earliest_end


# ---------------------------------------------------------------- terminal


def _dominant(bars: list[Bar], t0: float, t1: float) -> Bar | None:
    """The bar covering most of [t0, t1), or None when nothing was recorded there."""
    best, best_overlap = None, (t1 - t0) * 1e-6  # a sliver from rounding is not a bar
    for bar in bars:
        if bar.end <= t0:
            continue
        if bar.start >= t1:
            break
        overlap = min(bar.end, t1) - max(bar.start, t0)
        if overlap > best_overlap:
            best, best_overlap = bar, overlap
    return best


def _row(lane: Lane, picture: Picture, width: int) -> Text:
    text = Text()
    cell = picture.span / width
    for i in range(width):
        t0 = picture.start + i * cell
        bar = _dominant(lane.bars, t0, t0 + cell)
        if bar is None:
            text.append(" " if not lane.step_start <= t0 < lane.step_end else "-", style="grey30")
        elif bar.category == "idle":
            text.append("·", style=_TERM_STYLE["idle"])
        else:
            digit = str(bar.microbatch % 10) if bar.microbatch is not None else "#"
            text.append(digit, style=_TERM_STYLE[bar.category])
    return text


def _axis(picture: Picture, width: int, indent: int) -> Text:
    """Millisecond labels at the quarters of the step: the ends first, then the middle, then the rest if they fit."""
    line = [" "] * width
    taken = [False] * (width + 1)
    for k in (0, 4, 2, 1, 3):
        t = picture.span * k / 4
        label = f"{(picture.start + t) * 1e3:.0f}ms"
        center = round(t / picture.span * width)
        position = max(0, min(center - len(label) // 2 if 0 < k < 4 else center, width - len(label)))
        lo, hi = max(0, position - 1), min(width, position + len(label) + 1)
        if any(taken[lo:hi]):
            continue
        line[position : position + len(label)] = list(label)
        taken[position : position + len(label)] = [True] * len(label)
    return Text(" " * indent + "".join(line).rstrip(), style="grey50")


def _stats_table(picture: Picture) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("rank", "forward", "backward", "idle (waiting)", "not computing", "ideal bubble"):
        table.add_column(column, justify="right")
    for lane in picture.lanes:
        table.add_row(
            str(lane.rank),
            f"{lane.fraction('forward'):.0%}",
            f"{lane.fraction('backward'):.0%}",
            f"{lane.fraction('idle'):.0%}",
            f"{lane.not_computing:.0%}",
            f"{picture.ideal:.0%}",
        )
    return table


def _label_width(picture: Picture) -> int:
    return max(len(f"rank {lane.rank}") for lane in picture.lanes) + 1


def render_terminal(picture: Picture, width: int = 96) -> Group:
    """A Gantt chart: one row per rank, forward (blue) and backward (orange) cells show the microbatch."""
    label_width = _label_width(picture)
    rows: list[Any] = [Text(picture.title(), style="bold")]
    for lane in picture.lanes:
        rows.append(Text(f"rank {lane.rank}".ljust(label_width)) + _row(lane, picture, width))
    rows.append(_axis(picture, width, label_width))
    legend = Text(" " * label_width)
    legend.append("0", style=_TERM_STYLE["forward"]).append(" forward  ")
    legend.append("0", style=_TERM_STYLE["backward"]).append(" backward  ")
    legend.append("·", style=_TERM_STYLE["idle"]).append(" waiting  ")
    legend.append("-", style="grey30").append(" bookkeeping  (digit: microbatch)")
    rows += [legend, Text(""), _stats_table(picture), Text(picture.explanation(), style="grey62")]
    if picture.aligned:
        rows.append(Text("Ranks ran on different clocks: each row starts at its own step start.", style="yellow"))
    return Group(*rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smp-compat timeline",
        description="Draw one pipeline step from a Chrome trace written by smp_compat.timeline.gather_chrome_trace: "
        "a Gantt chart per rank in the terminal, and optionally an SVG or HTML file.",
        allow_abbrev=False,
    )
    parser.add_argument("trace", metavar="TRACE.json")
    parser.add_argument("--svg", metavar="FILE", help="write the picture as SVG")
    parser.add_argument("--html", metavar="FILE", help="write the picture and the numbers as an HTML page")
    parser.add_argument("--step", type=int, default=-1, help="which recorded step (default: the last)")
    parser.add_argument("--width", type=int, help="columns for the time axis (default: fit the terminal)")
    parser.add_argument("--pp", type=int, help="pipeline degree for the ideal (default: from the trace)")
    parser.add_argument("--microbatches", type=int, help="microbatches for the ideal (default: from the trace)")
    return parser


def _write(path: str, text: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")


def timeline_command(argv: Sequence[str]) -> int:
    """``smp-compat timeline TRACE.json [--svg out.svg] [--html out.html]``."""
    args = _parser().parse_args(list(argv))
    if args.width is not None and args.width < 20:
        raise SMPConfigError(
            f"--width must be at least 20 columns, got {args.width}; leave it out to fit the terminal."
        )
    events, other = load_trace(args.trace)
    picture = build_picture(events, other, args.step, args.pp, args.microbatches)
    console = Console(highlight=False)
    width = args.width or max(40, console.width - _label_width(picture) - 1)
    console.print(render_terminal(picture, width), soft_wrap=args.width is not None)
    for path, render in ((args.svg, render_svg), (args.html, render_html)):
        if path:
            _write(path, render(picture))
            print(f"wrote {path}")
    return 0


main = timeline_command
