"""``smp-compat check`` for SMP v2 scripts and configs: ``torch.sagemaker`` names and the nine v2 keys, judged by
the v2 registry (``support_v2.py``) and tsm.init's own validation (``SMPv2Config``)."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from smp_compat.cli.findings import ERROR, FileReport
from smp_compat.cli.support import Status
from smp_compat.cli.support_v2 import CONFIG_V2, lookup_api_v2
from smp_compat.errors import SMPConfigError
from smp_compat.v2.config import QUIET_V1_KEYS, SMPv2Config, rule_problems

__all__ = ["classify_api_v2", "record_v2_key", "record_v2_rules"]

PREFIX = "tsm."


def classify_api_v2(report: FileReport, rel: Sequence[str], line: int) -> None:
    """A name below ``torch.sagemaker`` (``rel``: its parts after it)."""
    if not rel:
        return
    found = lookup_api_v2(rel)
    if found is None:
        name = PREFIX + ".".join(rel)
        report.add("api", name, line, ERROR, f"{name} is not an SMP v2 (torch.sagemaker) name that smp_compat knows "
                   "(a typo, or an internal SMP name).", "Check it against the SMP v2 part of docs/api_support.md.")
        return
    entry, covered = found
    name = PREFIX + ".".join(rel if entry.group else rel[:covered])
    report.add("api", name, line, entry.status, entry.note, entry.action)


@functools.cache
def _adapter(key: str) -> TypeAdapter[Any]:
    info = SMPv2Config.model_fields[key]
    return TypeAdapter(info.annotation if not info.metadata else _annotated(info), config=ConfigDict(strict=True))


def _annotated(info: Any) -> Any:
    from typing import Annotated

    return Annotated[(info.annotation, *info.metadata)]


def _value_problem(key: str, value: Any) -> str | None:
    try:
        _adapter(key).validate_python(value)
    except ValidationError as exc:
        return "; ".join(err["msg"] for err in exc.errors())
    return None


def record_v2_key(report: FileReport, key: str, line: int, value: Any, known: bool, shown: str) -> None:
    """One key of an SMP v2 parameters dict, judged with its value when that is a literal."""
    if key in QUIET_V1_KEYS:
        report.add("config", key, line, Status.SUPPORTED, "An SMP v1 key SageMaker's SDK sends to v2 jobs: ignored.",
                   "", shown)  # fmt: skip
        return
    entry = CONFIG_V2.get(key)
    if entry is None:
        close = difflib.get_close_matches(key, sorted(CONFIG_V2), n=1, cutoff=0.6)
        report.add("config", key, line, ERROR, "Not an SMP v2 config key: tsm.init rejects it.",
                   f"Did you mean {close[0]!r}?" if close else "Remove it.", shown)  # fmt: skip
        return
    problem = _value_problem(key, value) if known else None
    if problem is not None:
        report.add("config", key, line, ERROR, f"tsm.init rejects this value: {problem}.", "", shown)
        return
    status = entry.status
    if entry.status is Status.UNSUPPORTED and known and value == SMPv2Config.model_fields[key].default:
        status = Status.SUPPORTED  # the default value of a refused feature is fine
    report.add("config", key, line, status, entry.note, entry.action if status is not Status.SUPPORTED else "", shown)


def record_v2_rules(report: FileReport, values: list[tuple[str, int, Any, bool]]) -> None:
    """SMP v2's rules between keys on a dict whose every v2 value is a valid literal: (key, line, value, known)."""
    mine = [v for v in values if v[0] in CONFIG_V2]
    if not mine or not all(known and _value_problem(key, value) is None for key, _, value, known in mine):
        return
    try:
        problems = rule_problems(SMPv2Config.model_construct(**{key: value for key, _, value, _ in mine}))
    except SMPConfigError as exc:
        problems = [str(exc)]
    for problem in problems:
        for key, line, _, _ in mine:
            if key in problem:
                report.add("config", key, line, ERROR, f"tsm.init rejects this combination: {problem}", "")
