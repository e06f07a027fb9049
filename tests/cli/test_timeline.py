"""The timeline picture: a hand-made trace drawn as terminal Gantt rows, SVG and HTML, with the right fractions."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from smp_compat import cli
from smp_compat.errors import SMPConfigError
from smp_compat.timeline import Span, Timeline
from smp_compat.cli.timeline import build_picture, load_trace, render_html, render_svg, render_terminal

T0 = 1000.0  # seconds on the monotonic clock where the recorded step starts
MS = 1e-3


def _timeline(rank: int, step: tuple[float, float], spans: list[tuple[str, float, float, int | None]]) -> Timeline:
    """A rank's recording: an earlier step (0) and the step under test (1), spans in ms from T0."""
    timeline = Timeline(rank=rank)
    timeline.add_step(T0 - 1.0, T0 - 0.9)
    timeline.add(Span("compute", "microbatch-0", "forward", T0 - 1.0, T0 - 0.95, 0))
    timeline.add_step(T0 + step[0] * MS, T0 + step[1] * MS)
    for category, start, end, mb in spans:
        name = "idle" if category == "idle" else f"microbatch-{mb}"
        timeline.add(Span("compute", name, category, T0 + start * MS, T0 + end * MS, mb))
    timeline.add(Span("send->1", "fwd", "comm", T0 + 0.01, T0 + 0.012))  # other tracks are not drawn
    return timeline


RANK0 = _timeline(0, (0, 100), [("forward", 0, 10, 0), ("forward", 10, 20, 1), ("idle", 20, 60, None),
                                ("backward", 60, 80, 0), ("backward", 80, 100, 1)])  # fmt: skip
RANK1 = _timeline(1, (5, 100), [("idle", 5, 10, None), ("forward", 10, 20, 0), ("backward", 20, 40, 0),
                                ("forward", 40, 50, 1), ("backward", 50, 60, 1), ("idle", 60, 100, None)])  # fmt: skip


def _events(*timelines: Timeline) -> list[dict[str, Any]]:
    return [event for timeline in timelines for event in timeline.chrome_events()]


def test_fractions_of_the_last_step() -> None:
    picture = build_picture(_events(RANK0, RANK1), {"pp": 2, "microbatches": 2, "pipeline": "interleaved"})
    assert (picture.step_index, picture.steps_recorded, picture.aligned) == (1, 2, False)
    rank0, rank1 = picture.lanes
    assert rank0.fraction("forward") == pytest.approx(0.2) and rank0.fraction("backward") == pytest.approx(0.4)
    assert rank0.fraction("idle") == pytest.approx(0.4) and rank0.not_computing == pytest.approx(0.4)
    assert rank1.duration == pytest.approx(0.095)
    assert rank1.fraction("idle") == pytest.approx(45 / 95) and rank1.not_computing == pytest.approx(45 / 95)
    assert picture.ideal == pytest.approx(1 / 3)
    assert picture.span == pytest.approx(0.1)
    assert "pp = 2, microbatches = 2, interleaved: step 2 of 2 recorded" in picture.title()
    assert RANK0.idle_fraction(last=1) == pytest.approx(rank0.fraction("idle"))  # same measure as the engine's


def test_terminal_rows_show_phase_and_microbatch() -> None:
    picture = build_picture(_events(RANK0, RANK1), {"pp": 2, "microbatches": 2})
    console = Console(width=120, record=True, color_system=None)
    console.print(render_terminal(picture, width=20))
    lines = console.export_text().splitlines()
    assert lines[1] == "rank 0 0011········00001111"
    assert lines[2].rstrip() == "rank 1  ·0000001111········"
    assert lines[3] == "       0ms     50ms   100ms"  # 20 columns leave no room for 25 and 75
    table = "\n".join(lines[5:])
    assert "ideal bubble" in table and "33%" in table and "47%" in table


def test_default_ideal_comes_from_the_trace_itself() -> None:
    picture = build_picture(_events(RANK0, RANK1))  # no otherData: ranks and microbatch numbers seen
    assert (picture.pp, picture.microbatches) == (2, 2)
    assert build_picture(_events(RANK0, RANK1), pp=4, microbatches=8).ideal == pytest.approx(3 / 11)


def test_earlier_step_and_step_range() -> None:
    picture = build_picture(_events(RANK0, RANK1), step=0)
    assert picture.step_index == 0 and picture.lanes[0].fraction("forward") == pytest.approx(0.5)
    with pytest.raises(SMPConfigError, match="out of range: every rank recorded 2 step"):
        build_picture(_events(RANK0, RANK1), step=2)


def test_ranks_on_different_clocks_are_aligned_at_their_step_start() -> None:
    far = _events(RANK1)
    for event in far:
        event["ts"] += 50e6  # another host: 50 s apart
    picture = build_picture(_events(RANK0) + far)
    assert picture.aligned
    assert picture.lanes[1].step_start == 0.0 and picture.lanes[1].bars[1].start == pytest.approx(0.005)


def test_svg_is_well_formed_and_has_every_bar() -> None:
    picture = build_picture(_events(RANK0, RANK1), {"pp": 2, "microbatches": 2})
    root = ET.fromstring(render_svg(picture))
    ns = "{http://www.w3.org/2000/svg}"
    fills = [rect.get("fill") for rect in root.iter(f"{ns}rect")]
    assert fills.count("#4C78A8") == 4 + 1 and fills.count("#F58518") == 4 + 1  # bars + legend swatch
    assert fills.count("#D4D4D4") == 3 + 1
    labels = [t.text for t in root.iter(f"{ns}text")]
    assert sorted(label for label in labels if label in ("0", "1")) == ["0", "0", "0", "0", "1", "1", "1", "1"]
    assert any("ideal 33%" in (label or "") for label in labels)
    page = render_html(picture)
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<td>40.0%</td>" in page


def test_command_writes_svg_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": _events(RANK0, RANK1), "otherData": {"pp": 2, "microbatches": 2}}))
    svg, page = tmp_path / "img" / "t.svg", tmp_path / "t.html"
    assert cli.main(["timeline", str(trace), "--svg", str(svg), "--html", str(page), "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert "rank 0" in out and f"wrote {svg}" in out and f"wrote {page}" in out
    ET.fromstring(svg.read_text())
    assert load_trace(trace)[1] == {"pp": 2, "microbatches": 2}


def test_bad_traces_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert cli.main(["timeline", str(empty)]) == 2
    assert "holds no step spans" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert cli.main(["timeline", str(broken)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    assert cli.main(["timeline", str(tmp_path / "missing.json")]) == 2
    assert "Cannot read the trace" in capsys.readouterr().err
