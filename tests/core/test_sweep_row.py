""".ci/sweep_row.py: the row of docs/versions.md's sweep table from pytest's JUnit report, with the counts
pytest printed, the first failures by name, and import smp_compat's refusal where there is no report."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2"
skipped="1" tests="6"><testcase classname="tests.a.test_x" name="test_ok" /><testcase classname="tests.a.test_x"
name="test_bad[1]"><failure message="AssertionError: 1 != 2&#10;more">trace</failure></testcase><testcase
classname="tests.b.test_y" name="test_slow"><failure message="TimeoutExpired: 30 s">trace</failure></testcase>
<testcase classname="tests.b.test_y" name="test_setup"><error message="fixture failed">trace</error></testcase>
<testcase classname="tests.b.test_y" name="test_skip"><skipped message="no GPU" /></testcase><testcase
classname="tests.b.test_y" name="test_ok2" /></testsuite></testsuites>"""


def _module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("sweep_row", ROOT / ".ci" / "sweep_row.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split(" | ")]


def test_counts_and_the_first_failures_come_from_the_report(tmp_path: Path) -> None:
    sweep_row = _module()
    (tmp_path / "junit.xml").write_text(JUNIT)
    passed, failed, skipped, failures = sweep_row.counts(tmp_path / "junit.xml")
    assert (passed, failed, skipped) == (2, 3, 1)
    assert failures[0] == "`tests.a.test_x::test_bad[1]`: AssertionError: 1 != 2"
    row = sweep_row.row(tmp_path / "junit.xml", tmp_path / "none.txt", 3725, "whole", "abc1234")
    cells = _cells(row)
    assert len(cells) == sweep_row.HEADER.splitlines()[0].count("|") - 1
    assert cells[4:10] == ["whole", "abc1234", "2", "3", "1", "62 min 5 s"]
    assert "test_slow" in cells[10] and "fixture failed" in cells[10] and "(3 in all)" not in cells[10]


def test_a_torch_that_import_refuses_gets_the_message_instead_of_counts(tmp_path: Path) -> None:
    sweep_row = _module()
    (tmp_path / "error.txt").write_text("Traceback ...\nSMPUnsupportedError: smp_compat needs torch >= 2.8; ...\n")
    cells = _cells(sweep_row.row(tmp_path / "junit.xml", tmp_path / "error.txt", 12, "quick", "abc1234"))
    assert cells[6:9] == ["-", "-", "-"]
    assert cells[10] == "`import smp_compat` fails: SMPUnsupportedError: smp_compat needs torch >= 2.8; ..."
