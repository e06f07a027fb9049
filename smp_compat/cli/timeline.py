"""``smp-compat timeline``: draw a pipeline step from the engine's Chrome trace, in the terminal and as SVG/HTML.

Reads the trace ``smp_compat.timeline.gather_chrome_trace`` writes (optionally with an ``otherData`` block
giving pp, microbatches and the schedule, as ``examples/timeline_demo.py`` writes it), picks one step, and
draws each rank's compute track: forward and backward work by colour with microbatch numbers, time spent
waiting for other ranks, and the measured idle fraction next to the ideal bubble (p-1)/(m+p-1).
"""

from __future__ import annotations

import argparse
import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

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
_SVG_FILL = {"forward": "#4C78A8", "backward": "#F58518", "idle": "#D4D4D4"}
_SVG_TEXT = {"forward": "#FFFFFF", "backward": "#1A1A1A", "idle": "#777777"}


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
    rows += [legend, Text(""), _stats_table(picture), Text(_explanation(picture), style="grey62")]
    if picture.aligned:
        rows.append(Text("Ranks ran on different clocks: each row starts at its own step start.", style="yellow"))
    return Group(*rows)


def _explanation(picture: Picture) -> str:
    return (f"ideal bubble (p-1)/(m+p-1) = ({picture.pp}-1)/({picture.microbatches}+{picture.pp}-1): equal stages, "
            "free communication; compare 'not computing'.")  # fmt: skip


# ---------------------------------------------------------------- SVG / HTML

_SVG_WIDTH, _LABEL_W, _ROW_H, _GAP, _TOP = 960, 70, 34, 10, 56


def _svg_bar(bar: Bar, y: float, scale: float, picture: Picture) -> list[str]:
    x = _LABEL_W + (bar.start - picture.start) * scale
    w = max((bar.end - bar.start) * scale, 0.5)
    parts = [f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{_ROW_H}" fill="{_SVG_FILL[bar.category]}"'
             f' stroke="#FFFFFF" stroke-width="0.5"><title>{bar.category} mb {bar.microbatch}: '
             f"{(bar.end - bar.start) * 1e3:.2f} ms</title></rect>"]  # fmt: skip
    if bar.category != "idle" and bar.microbatch is not None and w >= 9:
        parts.append(f'<text x="{x + w / 2:.2f}" y="{y + _ROW_H / 2 + 4:.1f}" text-anchor="middle" font-size="11" '
                     f'fill="{_SVG_TEXT[bar.category]}">{bar.microbatch}</text>')  # fmt: skip
    return parts


def render_svg(picture: Picture) -> str:
    """A self-contained SVG of the step (hand-written: no plotting dependency)."""
    plot_w = _SVG_WIDTH - _LABEL_W - 20
    scale = plot_w / picture.span
    lanes_h = len(picture.lanes) * (_ROW_H + _GAP)
    height = _TOP + lanes_h + 40 + 22 * (len(picture.lanes) + 2)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_SVG_WIDTH}" height="{height}" '
           f'viewBox="0 0 {_SVG_WIDTH} {height}" font-family="Helvetica, Arial, sans-serif">',
           f'<rect width="{_SVG_WIDTH}" height="{height}" fill="#FFFFFF"/>',
           f'<text x="{_LABEL_W}" y="22" font-size="15" font-weight="bold">{html.escape(picture.title())}'
           "</text>"]  # fmt: skip
    out += _svg_legend(_LABEL_W, 42)
    for i, lane in enumerate(picture.lanes):
        y = _TOP + i * (_ROW_H + _GAP)
        out.append(f'<text x="8" y="{y + _ROW_H / 2 + 5:.1f}" font-size="13">rank {lane.rank}</text>')
        x0 = _LABEL_W + (lane.step_start - picture.start) * scale
        out.append(f'<rect x="{x0:.2f}" y="{y}" width="{lane.duration * scale:.2f}" height="{_ROW_H}" '
                   'fill="#FFFFFF" stroke="#999999" stroke-width="0.6"/>')  # fmt: skip
        for bar in lane.bars:
            out += _svg_bar(bar, y, scale, picture)
    out += _svg_axis(picture, _TOP + lanes_h, scale)
    out += _svg_stats(picture, _TOP + lanes_h + 44)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_legend(x: float, y: float) -> list[str]:
    out = []
    for label, category in (("forward", "forward"), ("backward", "backward"), ("waiting for another rank", "idle")):
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{_SVG_FILL[category]}"/>')
        out.append(f'<text x="{x + 16}" y="{y}" font-size="12">{label}</text>')
        x += 26 + 7 * len(label)
    out.append(f'<text x="{x}" y="{y}" font-size="12" fill="#555555">numbers: microbatch; blank: engine '
               "bookkeeping</text>")  # fmt: skip
    return out


def _svg_axis(picture: Picture, y: float, scale: float) -> list[str]:
    out = [f'<line x1="{_LABEL_W}" y1="{y}" x2="{_LABEL_W + picture.span * scale:.2f}" y2="{y}" stroke="#888888"/>']
    for k in range(6):
        t = picture.span * k / 5
        x = _LABEL_W + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 5}" stroke="#888888"/>')
        out.append(f'<text x="{x:.2f}" y="{y + 18}" font-size="11" text-anchor="middle" fill="#555555">'
                   f"{(picture.start + t) * 1e3:.1f} ms</text>")  # fmt: skip
    return out


def _svg_stats(picture: Picture, y: float) -> list[str]:
    out = [f'<text x="{_LABEL_W}" y="{y}" font-size="12" font-weight="bold">idle (waiting) / not computing, '
           f"against the ideal bubble (p-1)/(m+p-1) = {picture.ideal:.0%}</text>"]  # fmt: skip
    for i, lane in enumerate(picture.lanes, start=1):
        out.append(f'<text x="{_LABEL_W}" y="{y + 20 * i}" font-size="12">rank {lane.rank}: forward '
                   f"{lane.fraction('forward'):.0%}, backward {lane.fraction('backward'):.0%}, idle "
                   f"{lane.fraction('idle'):.0%}, not computing {lane.not_computing:.0%} (ideal "
                   f"{picture.ideal:.0%})</text>")  # fmt: skip
    if picture.aligned:
        out.append(f'<text x="{_LABEL_W}" y="{y + 20 * (len(picture.lanes) + 1)}" font-size="11" fill="#AA5500">'
                   "ranks ran on different clocks: each row starts at its own step start</text>")  # fmt: skip
    return out


def render_html(picture: Picture) -> str:
    """An HTML page with the SVG and the numbers as a table."""
    rows = "\n".join(
        f"<tr><td>{lane.rank}</td><td>{lane.fraction('forward'):.1%}</td><td>{lane.fraction('backward'):.1%}</td>"
        f"<td>{lane.fraction('idle'):.1%}</td><td>{lane.not_computing:.1%}</td><td>{picture.ideal:.1%}</td></tr>"
        for lane in picture.lanes
    )
    meta = html.escape(json.dumps(picture.meta)) if picture.meta else ""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>smp_compat pipeline timeline</title>"
        "<style>body{font-family:Helvetica,Arial,sans-serif;margin:2em}td,th{padding:2px 10px;text-align:right}"
        "</style></head><body>\n"
        f"<h1>Pipeline timeline</h1>\n{render_svg(picture)}"
        "<table><tr><th>rank</th><th>forward</th><th>backward</th><th>idle (waiting)</th><th>not computing</th>"
        f"<th>ideal bubble</th></tr>\n{rows}\n</table>\n<p>{html.escape(_explanation(picture))}</p>\n"
        + (f"<p><small>run: {meta}</small></p>\n" if meta else "")
        + "</body></html>\n"
    )


# ---------------------------------------------------------------- command


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
