"""The timeline picture as a standalone SVG drawing, and as an HTML page with the drawing and its numbers.

``smp-compat timeline --svg/--html`` writes them (``timeline.py`` builds the picture and draws it in the
terminal).
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smp_compat.cli.timeline import Bar, Picture

__all__ = ["render_html", "render_svg"]

_SVG_WIDTH, _LABEL_W, _ROW_H, _GAP, _TOP = 960, 70, 34, 10, 56
_SVG_TEXT = {"forward": "#FFFFFF", "backward": "#1A1A1A", "idle": "#777777"}
_SVG_FILL = {"forward": "#4C78A8", "backward": "#F58518", "idle": "#D4D4D4"}


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
        f"<th>ideal bubble</th></tr>\n{rows}\n</table>\n<p>{html.escape(picture.explanation())}</p>\n"
        + (f"<p><small>run: {meta}</small></p>\n" if meta else "")
        + "</body></html>\n"
    )


# ---------------------------------------------------------------- command
