"""The smp.init() configuration: every SMP v1 key, strict types, aliases, cross-key rules and sources.

``schema.py`` is ``SMPConfig`` (keys, types, defaults, error wording), ``rules.py`` the rules between keys,
``sources.py`` where a config comes from and how sources merge. Part of the core: imports only
``smp_compat.errors``.
"""

from __future__ import annotations

from smp_compat.config.schema import ENV_VAR, NOT_ACTED_ON, SMP_KEYS, UNSUPPORTED, SMPConfig
from smp_compat.config.sources import extract_mp_parameters, parse_json, resolve_config

__all__ = [
    "ENV_VAR",
    "NOT_ACTED_ON",
    "SMP_KEYS",
    "SMPConfig",
    "UNSUPPORTED",
    "extract_mp_parameters",
    "parse_json",
    "resolve_config",
]
