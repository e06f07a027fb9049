"""A SageMaker job's hyperparameters: read them, and turn them into script arguments as SageMaker does.

SageMaker's Python SDK JSON-encodes every value, and its training toolkit decodes it again before it
builds the command line (``sagemaker_training.mapping.to_cmd_args``): keys sorted, ``--name`` (``-n`` for
a one-letter name), the value as Python's ``str`` of the decoded JSON, a dict as ``k=v`` pairs joined by
commas (keys sorted), ``null`` as an empty string. So ``true`` arrives as ``True``, ``[1, 2]`` as
``[1, 2]`` and ``{"a": 1}`` as ``a=1``. The environment gets each value JSON-encoded again
(``SM_HPS``, ``SM_HP_<NAME>``), strings as they are. Keys starting with ``sagemaker_`` are the SDK's
own framework settings: they go to ``SM_FRAMEWORK_PARAMS``, not to the script.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from smp_compat.cli.json_args import json_text
from smp_compat.errors import SMPConfigError

__all__ = ["FRAMEWORK_PREFIX", "env_value", "read_hyperparameters", "split_framework", "to_cmd_args"]

FRAMEWORK_PREFIX = "sagemaker_"
"""Hyperparameters the SDK adds for the container itself (``sagemaker_program``, ``sagemaker_mpi_enabled``...)."""


def read_hyperparameters(value: str, source: str = "--hyperparameters") -> dict[str, Any]:
    """``--hyperparameters``: a JSON object, inline (starts with ``{``) or in a file."""
    text, source = json_text(value, source, '{"epochs": 2, "lr": 0.001}')
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SMPConfigError(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}; text starts "
            f"{text[:120]!r}). Give one JSON object of name: value pairs, e.g. '{{\"epochs\": 2}}'."
        ) from None
    return check_hyperparameters(parsed, source)


def check_hyperparameters(parsed: Any, source: str) -> dict[str, Any]:
    """A dict with non-empty string keys (what SageMaker's CreateTrainingJob accepts)."""
    if not isinstance(parsed, dict):
        raise SMPConfigError(
            f"{source} must be a JSON object of name: value pairs, got {type(parsed).__name__} {parsed!r:.80}."
        )
    for key in parsed:
        if not key.strip():
            raise SMPConfigError(f"{source} has an empty hyperparameter name; every name must be non-empty.")
    return dict(parsed)


def split_framework(hps: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the script's hyperparameters, the ``sagemaker_*`` framework ones), as the toolkit splits them."""
    user = {k: v for k, v in hps.items() if not k.startswith(FRAMEWORK_PREFIX)}
    framework = {k: v for k, v in hps.items() if k.startswith(FRAMEWORK_PREFIX)}
    return user, framework


def _decode(value: Any) -> str:
    """The toolkit's text of one value: ``str`` of it, ``None`` as empty."""
    return "" if value is None else str(value)


def _arg_value(value: Any) -> str:
    """A dict becomes ``k=v,k2=v2`` (keys sorted); anything else its ``str``."""
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in sorted(value.items()))
    return _decode(value)


def to_cmd_args(hps: Mapping[str, Any]) -> list[str]:
    """``--name value`` pairs, keys sorted, exactly as SageMaker's toolkit gives them to the script."""
    args: list[str] = []
    for key in sorted(hps):
        name = _decode(key)
        args += [f"--{name}" if len(name) > 1 else f"-{name}", _arg_value(hps[key])]
    return args


def env_value(value: Any) -> str:
    """A value as the toolkit writes it into an ``SM_*`` variable: strings as they are, the rest compact JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
