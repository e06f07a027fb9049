"""What ``smp-compat check`` found in one file: findings (an SMP name or config key, its status and lines)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from smp_compat.cli.support import Status

__all__ = ["API_KINDS", "ERROR", "RANK", "FileReport", "Finding"]

ERROR = "error"
"""A status beyond the registry's: something SMP itself would reject too (unknown key or name, a config value
or combination of values that smp.init refuses, bad JSON)."""

RANK = {Status.SUPPORTED.value: 0, Status.PARTIAL.value: 1, Status.UNSUPPORTED.value: 2, ERROR: 3}
API_KINDS = ("api", "member")  # listed in the API table; the rest in the config table


@dataclass
class Finding:
    """One SMP name or config key used by one file, with every line it appears on."""

    kind: str  # "api", "member", "config", "config read", "launch"
    name: str
    status: str
    lines: list[int] = field(default_factory=list)
    note: str = ""
    action: str = ""
    values: list[str] = field(default_factory=list)

    def merge(self, line: int, status: str, note: str, action: str, value: str | None) -> None:
        """Another use: the worst status (and its explanation) wins; lines and values accumulate."""
        if line not in self.lines:
            self.lines.append(line)
            self.lines.sort()
        if value is not None and value not in self.values:
            self.values.append(value)
        if RANK[status] > RANK[self.status]:
            self.status, self.note, self.action = status, note, action


@dataclass
class FileReport:
    """Everything found in one file, in order of first appearance; ``error`` when it could not be read."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    error: str | None = None
    config_files: list[Path] = field(default_factory=list)

    def add(self, kind: str, name: str, line: int, status: Status | str, note: str = "", action: str = "",
            value: str | None = None) -> None:  # fmt: skip
        status = status.value if isinstance(status, Status) else status
        for finding in self.findings:
            if finding.kind == kind and finding.name == name:
                finding.merge(line, status, note, action, value)
                return
        self.findings.append(Finding(kind, name, status, [line], note, action, [] if value is None else [value]))

    def sorted_findings(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: (f.lines[0], f.kind not in API_KINDS))  # ties keep source order

    def worst(self) -> str:
        statuses = [f.status for f in self.findings] + ([ERROR] if self.error else [])
        return max(statuses, key=RANK.__getitem__, default=Status.SUPPORTED.value)
