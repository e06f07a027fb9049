"""The selftest's report: each rank's outcome of a check, merged into one row; the rich table; the JSON file.

JSON schema (``schema`` 1), documented in docs/troubleshooting.md: ``status`` ("pass"/"fail"), ``seconds``,
``environment`` (environment.Environment), ``checks``: one object per check with ``name``, ``about``,
``status`` (PASS/FAIL/SKIP), ``layout``, ``worst_difference``, ``rtol``, ``atol``, ``seconds``, ``reason``
(why it failed or was skipped), ``failed_ranks``, ``first_failure`` ({``rank``, ``error``} or null) and
``pipeline_links`` (per rank, how its pipeline messages travelled, or null).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from smp_compat.selftest.environment import Environment

__all__ = ["CheckReport", "Outcome", "merge", "not_run", "print_environment", "print_table", "to_json", "write_json"]

SCHEMA = 1


@dataclass(frozen=True)
class Outcome:
    """One rank's outcome of one check. ``kind``: "mismatch" (trained, but differs), "error" (raised), "echo"
    (raised because another rank failed or left: a lost connection), or None."""

    rank: int
    status: str
    seconds: float
    worst: float | None = None
    rtol: float | None = None
    atol: float | None = None
    layout: str | None = None
    detail: str | None = None
    kind: str | None = None
    diverged_at: float | None = None
    links: str | None = None

    def to_text(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_text(cls, text: str) -> Outcome:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class CheckReport:
    """A check over the whole job: the table's row and the JSON report's entry."""

    name: str
    about: str
    status: str
    seconds: float | None = None
    layout: str | None = None
    worst_difference: float | None = None
    rtol: float | None = None
    atol: float | None = None
    reason: str | None = None
    failed_ranks: list[int] = field(default_factory=list)
    first_failure: dict[str, Any] | None = None
    pipeline_links: dict[str, str] | None = None


_FIRST = ("error", "missing", "mismatch", "echo")  # which failing rank is named first: its own error wins


def merge(name: str, about: str, outcomes: dict[int, Outcome], world: int, waited: float) -> CheckReport:
    """Every rank's outcome as one row; a rank that gave none within the wait is a failure too (it died or hangs).

    The check's time is ``waited``: from the moment every rank was let start it until the last outcome (or the
    end of the wait), so the times add up to the battery's."""
    missing = [r for r in range(world) if r not in outcomes]
    failed = {r: o for r, o in outcomes.items() if o.status == "FAIL"}
    done = list(outcomes.values())
    seconds = waited
    worst = max((o.worst for o in done if o.worst is not None), default=None)
    first = done[0] if done else None
    links = {str(r): o.links for r, o in sorted(outcomes.items()) if o.links}
    common = {"seconds": seconds, "worst_difference": worst, "layout": first.layout if first else None,
              "rtol": first.rtol if first else None, "atol": first.atol if first else None,
              "pipeline_links": links or None}  # fmt: skip
    if not failed and not missing:
        skipped = [o for o in done if o.status == "SKIP"]
        if skipped:
            return CheckReport(name, about, "SKIP", reason=skipped[0].detail, **common)
        return CheckReport(name, about, "PASS", **common)
    why = {r: (o.kind or "error", o.detail or "failed", o.diverged_at or 0.0) for r, o in failed.items()}
    why.update({r: ("missing", f"gave no result within {waited:.0f} s (the process died or hangs)", 0.0)
                for r in missing})  # fmt: skip
    rank = min(why, key=lambda r: (_FIRST.index(why[r][0]), why[r][2], r))
    return CheckReport(name, about, "FAIL", reason=f"rank {rank}: {why[rank][1]}", failed_ranks=sorted(why),
                       first_failure={"rank": rank, "error": why[rank][1]}, **common)  # fmt: skip


def not_run(name: str, about: str, after: str) -> CheckReport:
    return CheckReport(name, about, "SKIP", reason=f"not run: the job stopped after {after} failed")


# ---------------------------------------------------------------- rendering


def _console() -> Console:
    """A terminal's width, but at least 120 columns: logs of batch jobs (no terminal) stay one line per check."""
    console = Console(markup=False, highlight=False, soft_wrap=False)
    if console.width < 120:
        console = Console(markup=False, highlight=False, soft_wrap=False, width=120)
    return console


def print_environment(env: Environment) -> None:
    """The environment report, above the checks: versions, hosts, each rank's device, backend and links."""
    console = _console()
    versions = ", ".join(f"{k} {v or '-'}" for k, v in env.versions.items())
    console.print(f"smp-compat selftest: {env.world_size} rank(s) on {len(env.hosts)} host(s)")
    console.print(f"versions: {versions}")
    console.print(f"backend: {env.backend} ({env.backend_reason}); every smp group uses it")
    console.print(f"pipeline links: {env.pipeline_links}")
    console.print(f"shim: {env.shim}")
    console.print(f"checkpoint key (rank 0): {env.ranks[0].checkpoint_key}")
    nccl = env.ranks[0].nccl_env
    console.print("NCCL variables: " + (" ".join(f"{k}={v}" for k, v in nccl.items()) if nccl else "none set"))
    for note in env.notes:
        console.print(f"note: {note}")
    table = Table(title="Ranks", box=box.SIMPLE)
    for column in ("host", "ranks", "devices"):
        table.add_column(column)
    for host, ranks in env.hosts.items():
        devices = [env.ranks[r] for r in ranks]
        gpus = devices[0].gpus
        used = " ".join(f"{d.rank}:{d.device}" for d in devices)
        kind = f"{gpus} GPU(s) ({devices[0].device_name})" if gpus and devices[0].device != "cpu" else "CPU"
        table.add_row(host, " ".join(map(str, ranks)), f"{kind}; {used}")
    console.print(table)


def _difference(row: CheckReport) -> str:
    return "-" if row.worst_difference is None else f"{row.worst_difference:.1e}"


def _tolerance(row: CheckReport) -> str:
    return "-" if row.rtol is None else f"{row.rtol:g}/{row.atol:g}"


def _link_kinds(row: CheckReport) -> str:
    """``pipeline: shared memory``: the ways pipeline messages travelled in this check, over all ranks."""
    if not row.pipeline_links:
        return ""
    kinds = sorted({part.split(": ", 1)[1] for text in row.pipeline_links.values() for part in text.split(", ")})
    return "pipeline: " + ", ".join(kinds)


def print_table(rows: list[CheckReport], seconds: float) -> None:
    """PASS / FAIL / SKIP per check with the worst difference, the time and why (rank 0 prints it)."""
    table = Table(title="smp-compat selftest", box=box.SIMPLE)
    for column, justify in (("check", "left"), ("layout", "left"), ("result", "left"), ("worst diff", "right"),
                            ("rtol/atol", "right"), ("time", "right"), ("details", "left")):  # fmt: skip
        wrap = column == "details"
        table.add_column(column, justify=justify, overflow="fold", no_wrap=not wrap)  # type: ignore[arg-type]
    for row in rows:
        time_text = f"{row.seconds:.1f} s" if row.seconds is not None else "-"
        details = _link_kinds(row) if row.status == "PASS" else row.reason or ""  # what each check does: --list
        table.add_row(row.name, row.layout or "-", row.status, _difference(row), _tolerance(row), time_text, details)
    console = _console()
    console.print(table)
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    console.print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {seconds:.1f} s")


def to_json(env: Environment, rows: list[CheckReport], seconds: float) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "status": "fail" if any(r.status == "FAIL" for r in rows) else "pass",
        "seconds": round(seconds, 3),
        "environment": env.to_json(),
        "checks": [asdict(r) for r in rows],
    }


def write_json(path: str, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
