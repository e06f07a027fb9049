"""SMP v2's nine config keys: types, defaults, ranges and cross-key rules, from ``tsm.init``'s argument and
``SM_HP_MP_PARAMETERS`` (the estimator's keys win, as on SageMaker).

REF ("The SageMaker model parallel library v2 reference") lists the keys; SMP_V2_REFERENCE.md §2.1 has the
table. Keys of SMP v1 that SageMaker's own SDK sends to v2 jobs (``placement_strategy``) are accepted quietly;
any other key is an error naming the nearest valid one.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from smp_compat.config.schema import SMP_KEYS as V1_KEYS
from smp_compat.config.sources import extract_mp_parameters, parse_json
from smp_compat.errors import SMPConfigError

__all__ = [
    "ENV_VAR",
    "QUIET_V1_KEYS",
    "V2_KEYS",
    "SMPv2Config",
    "resolve_v2_config",
    "world_problems",
]

log = logging.getLogger(__name__)

ENV_VAR = "SM_HP_MP_PARAMETERS"
"""SageMaker's toolkit turns the estimator's ``mp_parameters`` hyperparameter into this variable (JSON)."""

QUIET_V1_KEYS = frozenset({"placement_strategy", "ddp"})
"""v1 keys a v2 job may carry without meaning anything: SageMaker's SDK sends ``placement_strategy`` to v2
containers itself (its recipe path), and ``ddp: true`` is what v2 always does. Dropped with a debug line."""

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]


class SMPv2Config(BaseModel):
    """The resolved SMP v2 configuration (attribute names are SMP's key names)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True)

    hybrid_shard_degree: NonNegInt = 0
    """Ranks per FSDP shard group (counting context-parallel ranks); 0 = the largest (or native FSDP at tp 1)."""
    sm_activation_offloading: bool = True
    """SMP's prefetching activation offload; the scripts also gate torch's offload_wrapper on it."""
    activation_loading_horizon: PosInt = 2
    """Offloaded layers whose inputs may be back on the device at once (prefetch depth; a speed knob)."""
    fsdp_cache_flush_warnings: bool = True
    """Warn when the CUDA caching allocator flushes."""
    allow_empty_shards: bool = False
    """Allow empty shards when a tensor does not divide evenly."""
    tensor_parallel_degree: PosInt = 1
    """Tensor-parallel degree; takes effect through tsm.transform."""
    context_parallel_degree: PosInt = 1
    """Context-parallel degree (sequence split); must not exceed hybrid_shard_degree."""
    expert_parallel_degree: PosInt = 1
    """Expert-parallel degree for MoE models; not combinable with tensor parallelism."""
    random_seed: NonNegInt = 12345
    """Seed of the tensor-parallel RNG tracker (tp_rank is added); REF states no default, MoEConfig's is 12345."""

    def __init__(self, **data: Any) -> None:
        """Validate, turning pydantic's report into one SMPConfigError."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            lines = [line for err in exc.errors() for line in _describe(err).splitlines()]
            raise SMPConfigError(_header(lines)) from None

    @model_validator(mode="after")
    def _cross_key_rules(self) -> SMPv2Config:
        """SMP's rules between keys that hold whatever the world size."""
        problems = rule_problems(self)
        if problems:
            raise PydanticCustomError("smp_rules", "{problems}", {"problems": "\n".join(problems)})
        return self

    def check_world_size(self, world_size: int) -> None:
        """The degrees against the number of processes, as tsm.init checks them."""
        problems = world_problems(self, world_size)
        if problems:
            raise SMPConfigError(_header(problems))


V2_KEYS: frozenset[str] = frozenset(SMPv2Config.model_fields)
"""The nine SMP v2 keys."""


def rule_problems(cfg: SMPv2Config) -> list[str]:
    """Cross-key rules independent of the world size, one message each."""
    tp, cp, ep, hsd = (cfg.tensor_parallel_degree, cfg.context_parallel_degree, cfg.expert_parallel_degree,
                       cfg.hybrid_shard_degree)  # fmt: skip
    problems = []
    if hsd >= 1 and cp > hsd:
        problems.append(
            f"context_parallel_degree ({cp}) cannot exceed hybrid_shard_degree ({hsd}): the context-parallel ranks "
            f"sit inside the shard group; raise hybrid_shard_degree to a multiple of {cp} or lower "
            "context_parallel_degree."
        )
    elif hsd >= 1 and hsd % cp:
        problems.append(
            f"hybrid_shard_degree ({hsd}) must be a multiple of context_parallel_degree ({cp}): a shard group "
            f"holds whole context-parallel groups; use {hsd - hsd % cp or cp} or {hsd + cp - hsd % cp}."
        )
    if ep > 1 and tp > 1:
        problems.append(
            f"expert_parallel_degree ({ep}) cannot be combined with tensor_parallel_degree ({tp}) in SMP v2; "
            "set one of them to 1."
        )
    return problems


def world_problems(cfg: SMPv2Config, world_size: int) -> list[str]:
    """The degrees against the world size: each divides what it splits, one message each."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return [f"the world size must be a positive int, got {world_size!r}"]
    tp, cp, ep, hsd = (cfg.tensor_parallel_degree, cfg.context_parallel_degree, cfg.expert_parallel_degree,
                       cfg.hybrid_shard_degree)  # fmt: skip
    if world_size % (tp * cp):
        return [
            f"tensor_parallel_degree ({tp}) x context_parallel_degree ({cp}) = {tp * cp} must divide the "
            f"number of processes ({world_size}); change a degree or the process count."
        ]
    problems = []
    per_tp = world_size // tp
    if hsd > per_tp:
        problems.append(
            f"hybrid_shard_degree ({hsd}) cannot exceed world size / tensor_parallel_degree = "
            f"{world_size} / {tp} = {per_tp}; the valid range is 0 to {per_tp}."
        )
    elif hsd >= 1 and per_tp % hsd:
        problems.append(
            f"hybrid_shard_degree ({hsd}) must divide world size / tensor_parallel_degree = {per_tp} (the shard "
            f"groups must tile the data-parallel ranks); use one of {_divisors(per_tp, cp)}."
        )
    dp = world_size // (tp * cp)
    if ep > 1 and dp % ep:
        problems.append(
            f"expert_parallel_degree ({ep}) must divide the data-parallel size ({dp}); use one of "
            f"{_divisors(dp, 1)}."
        )
    return problems


def _divisors(n: int, multiple_of: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d % multiple_of == 0]


def resolve_v2_config(
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    written: Mapping[str, Any] | None = None,
) -> SMPv2Config:
    """Merge, lowest first: values the script wrote to ``tsm.state`` before init, ``init``'s dict or JSON file,
    then SM_HP_MP_PARAMETERS (key by key, as SageMaker's estimator overrides init's argument); validate."""
    base = _clean(_load_argument(config), "the config passed to tsm.init()")
    raw_env = (os.environ if environ is None else environ).get(ENV_VAR, "")
    env = _clean(extract_mp_parameters(parse_json(raw_env, ENV_VAR)), ENV_VAR) if raw_env.strip() else {}
    merged = {**dict(written or {}), **base, **env}
    try:
        return SMPv2Config(**merged)
    except SMPConfigError as exc:
        if not env:
            raise
        raise SMPConfigError(f"{exc}\n(Keys taken from {ENV_VAR}, which override tsm.init's: {', '.join(sorted(env))}.)"
                             ) from None


def _load_argument(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """tsm.init's argument: nothing, a dict (bare keys or a SageMaker distribution dict), or a JSON file path."""
    if config is None:
        return {}
    if isinstance(config, str | os.PathLike):
        try:
            text = Path(config).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SMPConfigError(
                f"Cannot read the SMP v2 config file {str(config)!r}: {exc}; pass an existing JSON file or a dict."
            ) from None
        return extract_mp_parameters(parse_json(text, f"the config file {str(config)!r}"))
    return extract_mp_parameters(config)


def _clean(params: Mapping[Any, Any], source: str) -> dict[str, Any]:
    """Drop the quiet v1 keys; every other key that is not a v2 key is one problem line."""
    out, problems = {}, []
    for key, value in params.items():
        if key in V2_KEYS:
            out[key] = value
        elif key in QUIET_V1_KEYS:
            log.debug("%s: ignoring SMP v1 key %r=%r (no meaning in SMP v2)", source, key, value)
        elif isinstance(key, str) and key in V1_KEYS:
            problems.append(
                f'"{key}" is an SMP v1 key (smdistributed.modelparallel) with no meaning in SMP v2; remove it '
                f"(SMP v2's keys: {', '.join(sorted(V2_KEYS))})."
            )
        else:
            problems.append(_unknown_key(key, value))
    if problems:
        raise SMPConfigError(_header(problems, f" in {source}"))
    return out


def _unknown_key(key: Any, value: Any) -> str:
    close = difflib.get_close_matches(str(key).lower(), sorted(V2_KEYS), n=1, cutoff=0.6)
    guess = f'did you mean "{close[0]}"?' if close else "no SMP v2 key is close."
    return f"unknown key {str(key)!r} (value {value!r}); {guess} The SMP v2 keys: {', '.join(sorted(V2_KEYS))}."


def _header(lines: list[str], where: str = "") -> str:
    plural = "s" if len(lines) > 1 else ""
    return "\n".join([f"Invalid SMP v2 configuration{where} ({len(lines)} problem{plural}):",
                      *(f"  - {line}" for line in lines)])  # fmt: skip


_TYPE_WORDS = {"int_type": "an int", "bool_type": "a bool (true or false)"}
_BOUND_WORDS = {"greater_than_equal": ">="}


def _describe(err: ErrorDetails) -> str:
    """One pydantic error in our words: key, value seen, what is expected."""
    if not err["loc"]:
        ctx = err.get("ctx") or {}
        return str(ctx.get("problems") or err["msg"])
    key, value = str(err["loc"][0]), err.get("input")
    seen = f"got {value!r} ({type(value).__name__})"
    if err["type"] in _TYPE_WORDS:
        hint = "; write the value without quotes" if isinstance(value, str) else ""
        return f"{key}: expected {_TYPE_WORDS[err['type']]}, {seen}{hint}."
    if err["type"] in _BOUND_WORDS:
        bound = next(iter((err.get("ctx") or {}).values()), "?")
        return f"{key}: must be {_BOUND_WORDS[err['type']]} {bound}, {seen}."
    return f"{key}: {err['msg']}, {seen}."
