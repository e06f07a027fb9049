"""``smp-compat check``: read SMP scripts and configs (without running them) and report what smp_compat supports.

Scripts are read by ``scan.py``; JSON configs (a SageMaker distribution dict, its modelparallel section or
bare parameters) here. Each finding is looked up in :mod:`smp_compat.cli.support`, the registry the docs
table is generated from.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from smp_compat.cli.check_config import ConfigValue, record_config_key, record_config_rules, record_mpi_key
from smp_compat.cli.check_v2 import record_v2_key, record_v2_rules
from smp_compat.cli.findings import API_KINDS, ERROR, RANK, FileReport, Finding
from smp_compat.cli.scan import check_source
from smp_compat.cli.support import Status

__all__ = ["ERROR", "FileReport", "Finding", "check_command", "check_file", "check_json", "check_source", "main"]

_STYLE = {"supported": "green", "partial": "yellow", "unsupported": "bold red", ERROR: "bold magenta"}


# ---------------------------------------------------------------- JSON configs


def _key_lines(text: str) -> dict[str, list[int]]:
    """Line numbers of every ``"key":`` in a JSON text (JSON parsers keep no positions)."""
    lines: dict[str, list[int]] = {}
    for match in re.finditer(r'"((?:[^"\\]|\\.)*)"\s*:', text):
        lines.setdefault(match.group(1), []).append(text.count("\n", 0, match.start()) + 1)
    return lines


def _line_after(lines: dict[str, list[int]], key: str, after: int) -> int:
    candidates = lines.get(key, [])
    return next((n for n in candidates if n >= after), candidates[0] if candidates else 1)


def check_json(path: Path, display: str | None = None) -> FileReport:
    """Check a JSON config: a SageMaker distribution dict, its modelparallel section, or bare SMP parameters."""
    report = FileReport(display or str(path))
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        report.error = f"cannot read: {exc}"
        return report
    except json.JSONDecodeError as exc:
        report.error = f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        return report
    if not isinstance(data, dict):
        report.error = f"expected a JSON object, got {type(data).__name__}"
        return report
    lines = _key_lines(text)
    section = data.get("smdistributed", data)
    section = section.get("modelparallel", section) if isinstance(section, dict) else section
    if isinstance(section, dict) and ("enabled" in section or "parameters" in section):
        params = section.get("parameters", {})
    else:
        params = section
    start = lines.get("parameters", [1])[0] if params is not data else 1
    if isinstance(params, dict) and _is_v2(data, params):
        v2_values = []
        for key, value in params.items():
            if params is data and key == "torch_distributed":
                continue
            line = _line_after(lines, key, start)
            record_v2_key(report, key, line, value, True, json.dumps(value))
            v2_values.append((key, line, value, True))
        record_v2_rules(report, v2_values)
    elif isinstance(params, dict):
        values: list[ConfigValue] = []
        for key, value in params.items():
            if params is data and key in ("mpi", "smdistributed"):
                continue
            line = _line_after(lines, key, start)
            record_config_key(report, key, line, value, True, json.dumps(value))
            values.append(ConfigValue(key, line, value, True))
        record_config_rules(report, values)
    mpi = data.get("mpi")
    if isinstance(mpi, dict):
        mpi_start = lines.get("mpi", [1])[0]
        for key, value in mpi.items():
            record_mpi_key(report, key, _line_after(lines, key, mpi_start), json.dumps(value))
    return report


def _is_v2(data: dict, params: dict) -> bool:
    """SMP v2's config: a distribution with ``torch_distributed`` (the SDK's rule), or a v2-only key."""
    from smp_compat.cli.launch_config import _V2_ONLY_KEYS

    return "torch_distributed" in data or bool(_V2_ONLY_KEYS & set(params))


def check_file(path: Path, display: str | None = None) -> FileReport:
    """Check one file: ``.json`` files are configs, anything else is read as a Python script."""
    if path.suffix == ".json":
        return check_json(path, display)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return FileReport(display or str(path), error=f"cannot read: {exc}")
    return check_source(text, display or str(path), path)


# ---------------------------------------------------------------- output


def _expand(paths: Sequence[str]) -> list[Path]:
    """Files as given; directories contribute their ``*.py`` files (recursively, sorted)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return out


def _lines_text(lines: list[int]) -> str:
    return ", ".join(str(n) for n in lines)


def _explanation(finding: Finding) -> str:
    """Why and what to do, for rows that need attention (supported rows stay quiet; --json has every note)."""
    if finding.status == Status.SUPPORTED.value:
        return ""
    return " ".join([finding.note, f"-> {finding.action}" if finding.action else ""]).strip()


def _table(title: str, findings: list[Finding], with_values: bool) -> Table:
    """One row per name or key: where, value (config keys), status, and what to change when it matters."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("line", justify="right", max_width=10)
    table.add_column("name", min_width=18, max_width=44, overflow="fold")
    if with_values:
        table.add_column("value", max_width=18, overflow="fold")
    table.add_column("status", no_wrap=True)
    table.add_column("note / what to do", overflow="fold", ratio=1)
    for f in findings:
        label = f.name if f.kind in ("api", "member", "config") else f"{f.name} ({f.kind})"
        cells = [_lines_text(f.lines), label] + ([", ".join(f.values)] if with_values else [])
        table.add_row(*cells, Text(f.status, style=_STYLE[f.status]), _explanation(f))
    return table


def _file_tables(report: FileReport) -> list[Table]:
    """The SMP API uses, then the config keys (with their values), each in line order."""
    findings = report.sorted_findings()
    api = [f for f in findings if f.kind in API_KINDS]
    config = [f for f in findings if f.kind not in API_KINDS]
    tables = [_table(f"{report.path}: SMP API", api, False)] if api else []
    if config:
        tables.append(_table(f"{report.path}: config", config, True))
    return tables


def _summary(reports: list[FileReport]) -> dict[str, int]:
    counts = {status: 0 for status in RANK}
    for report in reports:
        for finding in report.findings:
            counts[finding.status] += 1
    return counts


def _print_reports(reports: list[FileReport], console: Console) -> None:
    for report in reports:
        if report.error:
            console.print(Text(f"{report.path}: {report.error}", style=_STYLE[ERROR]))
            continue
        if not report.findings:
            console.print(f"{report.path}: no SMP API or config key found.")
        for table in _file_tables(report):  # none without findings; the notes below still show
            console.print(table)
        for hint in report.hints:
            console.print(f"  note: {hint}")
    counts = _summary(reports)
    blocked = counts[Status.UNSUPPORTED.value] or counts[ERROR]
    verdict = ("Change the unsupported and error rows before running under smp_compat (docs/porting.md)." if blocked
               else "Nothing blocks running under smp_compat.")  # fmt: skip
    listed = ", ".join(f"{n} {status}" for status, n in counts.items())
    console.print(f"{sum(counts.values())} findings: {listed}. {verdict}", soft_wrap=True)


def _as_json(reports: list[FileReport]) -> str:
    files = [
        {"path": r.path, "error": r.error, "hints": r.hints, "findings": [asdict(f) for f in r.sorted_findings()]}
        for r in reports
    ]
    return json.dumps({"files": files, "summary": _summary(reports)}, indent=2)


def _check_all(paths: list[Path]) -> list[FileReport]:
    """Every file given, then the config files that scripts pass to smp.init by path (each once)."""
    reports = [check_file(path, str(path)) for path in paths]
    done = {path.resolve() for path in paths}
    for report in list(reports):
        for extra in report.config_files:
            if extra.resolve() not in done:
                done.add(extra.resolve())
                reports.append(check_file(extra, str(extra)))
    return reports


def check_command(argv: list[str]) -> int:
    """``smp-compat check``: exit 0 when nothing is unsupported or an error, 1 when something is, 2 when a file is
    unreadable."""
    parser = argparse.ArgumentParser(
        prog="smp-compat check",
        description="List every SMP v1 API and config key that scripts and JSON configs use, with its status in "
        "smp_compat and what to change; literal config values are validated as smp.init does. Nothing is run. "
        "Exit status: 0 nothing unsupported, 1 something unsupported or invalid, 2 a file could not be read.",
        allow_abbrev=False,
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python scripts, JSON configs, or directories")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    reports = _check_all(_expand(args.paths))
    if args.json:
        print(_as_json(reports))
    else:
        _print_reports(reports, Console(highlight=False))
    if any(r.error for r in reports):
        return 2
    worst = max((RANK[r.worst()] for r in reports), default=0)
    return 1 if worst >= RANK[Status.UNSUPPORTED.value] else 0


main = check_command
