"""``smp-compat check``, continued: judging config keys and values as smp.init would.

A key is looked up in the registry (:mod:`smp_compat.cli.support`); a literal value goes through smp.init's
own validation (``SMPConfig``'s field types), and the rules between keys (``config.rules``) are applied
when every value of the dict is a valid literal. ``smp.state.cfg.<key>`` reads and SageMaker's ``mpi``
settings are judged here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from smp_compat.cli.findings import ERROR, FileReport
from smp_compat.cli.support import CONFIG, Status, config_value_status, suggest_key
from smp_compat.config import SMPConfig
from smp_compat.config.rules import rule_problems
from smp_compat.config.schema import FIELD_BY_KEY, canonical_key, canonicalize, value_problem
from smp_compat.errors import SMPConfigError

__all__ = ["ConfigValue", "config_read", "record_config_key", "record_config_rules", "record_mpi_key"]

_MPI_KEYS = {
    "enabled": (Status.SUPPORTED, "MPI launch settings: smp-compat run starts the processes with torchrun.", ""),
    "processes_per_host": (Status.SUPPORTED, "The default --nproc-per-node of smp-compat run.", ""),
    "custom_mpi_options": (Status.PARTIAL, "Ignored: the processes are started by torchrun, not mpirun.",
                           "Pass launcher options to smp-compat run (torchrun options) or to srun/mpirun."),
}  # fmt: skip


def config_read(report: FileReport, key: str, line: int) -> None:
    """``smp.state.cfg.<key>``: the resolved config holds every key; a key not acted on is worth a look."""
    name = f"smp.state.cfg.{key}"
    entry = CONFIG.get(key)
    if entry is None:
        if not key.startswith("_") and hasattr(SMPConfig, key):
            report.add("config read", name, line, Status.SUPPORTED, "An attribute of smp_compat's resolved config.")
            return
        report.add("config read", name, line, ERROR, f"The config has no key {key!r}.", _did_you_mean(key))
        return
    if entry.status is Status.PARTIAL:
        report.add("config read", name, line, Status.PARTIAL, f"Holds the configured value, but smp_compat does not "
                   f"act on {key}: code that branches on it may expect SMP behaviour that is missing here.",
                   entry.action)  # fmt: skip
    else:
        always_default = entry.status is Status.UNSUPPORTED
        note = "Holds the configured value." + (" (Always the default here.)" if always_default else "")
        report.add("config read", name, line, Status.SUPPORTED, note)


def _did_you_mean(key: str) -> str:
    close = suggest_key(key)
    return ("Did you mean " + " or ".join(repr(c) for c in close) + "?") if close else "Remove it."


def record_config_key(report: FileReport, key: str, line: int, value: Any, known: bool, shown: str) -> None:
    """One key of an SMP parameters dict, judged with its value when that is a literal.

    A literal value that smp.init refuses (an int for a float key, ``"true"`` for a bool, ``"Cluster"``) is an
    error with the schema's own message; a value computed at run time is never judged that way.
    """
    if key not in CONFIG:
        report.add("config", key, line, ERROR, "Not an SMP v1 config key: SMP and smp_compat both reject unknown "
                   "keys at smp.init.", _did_you_mean(key), shown)  # fmt: skip
        return
    problem = value_problem(key, value) if known else None
    if problem is not None:
        report.add("config", key, line, ERROR, f"smp.init rejects this value: {problem}", "", shown)
        return
    status, note = config_value_status(key, value, known)
    report.add("config", key, line, status, note, CONFIG[key].action if status is not Status.SUPPORTED else "", shown)


@dataclass
class ConfigValue:
    """One key of a config dict, for the rules between keys; ``known``: its value is a literal."""

    key: str
    line: int
    value: Any = None
    known: bool = False


def record_config_rules(report: FileReport, values: list[ConfigValue]) -> None:
    """The rules between keys that smp.init applies (``rules.rule_problems``, aliases given twice), on a dict
    whose every value is a valid literal (a JSON file, a literal dict); otherwise nothing is judged."""
    values = [v for v in values if canonical_key(v.key) in FIELD_BY_KEY]
    if not values or not all(v.known and value_problem(v.key, v.value) is None for v in values):
        return
    try:
        params = canonicalize({v.key: v.value for v in values}, "the config")
        problems = rule_problems(SMPConfig.model_construct(**params))  # each value was validated above
    except SMPConfigError as exc:  # one key spelled twice (`partitions` and `pipeline_parallel_degree`)
        problems = [str(exc)]
    for problem in problems:
        named = [v for v in values if _names(problem, v.key)] or values[:1]
        for v in named:
            report.add("config", v.key, v.line, ERROR, f"smp.init rejects this combination: {problem}", "")


def _names(problem: str, key: str) -> bool:
    """Whether a rule's message is about ``key`` (an alias counts as its SMP name)."""
    return re.search(rf"(?<!\w){re.escape(canonical_key(key))}(?!\w)", problem) is not None


def record_mpi_key(report: FileReport, key: str, line: int, shown: str) -> None:
    status, note, action = _MPI_KEYS.get(key, (ERROR, "Not a SageMaker mpi setting.", "Remove it."))
    report.add("launch", f"mpi.{key}", line, status, note, action, shown)
