"""Where an SMP config comes from: smp.init's dict or JSON file, a SageMaker distribution dict, and
SM_HP_MP_PARAMETERS (which wins key by key); ``resolve_config`` merges them and validates."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from smp_compat.config.schema import ENV_VAR, FIELD_BY_KEY, UNSUPPORTED, SMPConfig, canonicalize
from smp_compat.errors import SMPConfigError, SMPUnsupportedError

__all__ = ["extract_mp_parameters", "parse_json", "resolve_config"]


def extract_mp_parameters(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Return the bare SMP parameters from a SageMaker `distribution` dict, its `modelparallel` part, or themselves."""
    if not isinstance(obj, Mapping):
        raise SMPConfigError(
            f"The SMP config must be a dict, got {type(obj).__name__} ({obj!r:.80}); pass a dict such as "
            '{"pipeline_parallel_degree": 2, "microbatches": 4}.'
        )
    if "smdistributed" in obj:
        section = obj["smdistributed"]
        if not isinstance(section, Mapping) or "modelparallel" not in section:
            raise SMPConfigError(
                f'The distribution dict\'s "smdistributed" entry has no "modelparallel" section (got {section!r:.120}); '
                'write {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {...}}}}.'
            )
        obj = section
    if "modelparallel" in obj:
        return _modelparallel_parameters(obj["modelparallel"])
    return dict(obj)


def _modelparallel_parameters(section: Any) -> dict[str, Any]:
    """The `parameters` of an `{"enabled": ..., "parameters": {...}}` section; `enabled: false` is an error."""
    if not isinstance(section, Mapping) or set(section) - {"enabled", "parameters"}:
        raise SMPConfigError(
            f'The "modelparallel" section must be {{"enabled": True, "parameters": {{...}}}}, got {section!r:.160}; '
            "put the SMP keys inside \"parameters\"."
        )
    if section.get("enabled", True) is not True:
        raise SMPConfigError(
            f'The "modelparallel" section has "enabled": {section.get("enabled")!r}, so model parallelism is off, '
            'yet smp.init() was called; set "enabled": True or do not call smp.init().'
        )
    params = section.get("parameters", {})
    if not isinstance(params, Mapping):
        raise SMPConfigError(
            f'"modelparallel"."parameters" must be a dict, got {type(params).__name__} ({params!r:.80}); '
            "load a JSON file yourself, or pass its path as the whole config."
        )
    return dict(params)


def _load_source(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """The parameters given to smp.init(): nothing, a dict, or a path to a JSON file with the same dict."""
    if config is None:
        return {}
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SMPConfigError(
                f"Cannot read the SMP config file {str(path)!r}: {exc}; pass an existing JSON file or a dict."
            ) from None
        return canonicalize(extract_mp_parameters(parse_json(text, f"the config file {str(path)!r}")), str(path))
    return canonicalize(extract_mp_parameters(config), "the config passed to smp.init()")


def _load_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The parameters in SM_HP_MP_PARAMETERS (empty when unset or blank)."""
    raw = environ.get(ENV_VAR, "")
    if not raw.strip():
        return {}
    return canonicalize(extract_mp_parameters(parse_json(raw, ENV_VAR)), ENV_VAR)


def parse_json(text: str, source: str) -> Any:
    """json.loads with an error that names where the text came from."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SMPConfigError(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}; text starts "
            f"{text[:120]!r}). Give one JSON object: a SageMaker distribution dict, or the SMP parameters."
        ) from None


def _is_non_default(value: Any, default: Any) -> bool:
    """True for a well-typed value other than the default (a wrongly typed one is left to validation)."""
    if default is None:
        return value is not None
    return type(value) is type(default) and value != default


def _check_unsupported(params: Mapping[str, Any]) -> None:
    """Refuse features we lack before the cross-key rules, so the user hears the real obstacle first."""
    for key, feature in UNSUPPORTED.items():
        default = SMPConfig.model_fields[FIELD_BY_KEY[key]].default
        if key in params and _is_non_default(params[key], default):
            raise SMPUnsupportedError(
                f"{key}={params[key]!r} asks for {feature}, which smp_compat does not implement yet; set "
                f'"{key}": {default!r} (or remove the key) to run without it.'
            )


def resolve_config(
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> SMPConfig:
    """Merge smp.init's config with SM_HP_MP_PARAMETERS (the environment wins per key), then validate."""
    base = _load_source(config)
    env = _load_env(os.environ if environ is None else environ)
    merged = {**base, **env}
    _check_unsupported(merged)
    try:
        return SMPConfig(**merged)
    except SMPConfigError as exc:
        if not env:
            raise
        overridden = ", ".join(sorted(env))
        raise SMPConfigError(f"{exc}\n(Keys taken from {ENV_VAR}, which override smp.init's: {overridden}.)") from None
