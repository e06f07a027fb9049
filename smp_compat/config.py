"""The smp.init() configuration: every SMP v1 key, strict types, aliases, cross-key rules and sources."""

from __future__ import annotations

import difflib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from smp_compat.errors import SMPConfigError, SMPUnsupportedError

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

ENV_VAR = "SM_HP_MP_PARAMETERS"
"""Where SageMaker puts the estimator's mp parameters (JSON); every key there overrides smp.init's dict."""

_ALIASES: dict[str, str] = {"partitions": "pipeline_parallel_degree"}
_DOCS_HINT = "the valid keys are listed in smp_compat.config.SMP_KEYS and in the SMP v1 parameter table (docs/)"
_PLACEMENT_PERMUTATIONS = frozenset({"DPT", "DTP", "PDT", "PTD", "TDP", "TPD"})
_PLACEMENT_NAMED = {"cluster": "DPT", "spread": "TPD"}


def _exact_float(value: Any) -> Any:
    """Reject ints (and bools) for float keys before pydantic would widen them, as SMP v1 did."""
    if isinstance(value, int):
        raise PydanticCustomError("float_exact", "an int where a float is required")
    return value


def _placement(value: str) -> str:
    """Accept "cluster", "spread" or a permutation of D, P, T (upper case), as the SMP library did."""
    if value in _PLACEMENT_NAMED or value in _PLACEMENT_PERMUTATIONS:
        return value
    raise PydanticCustomError("placement", "not a placement strategy")


PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
ExactFloat = Annotated[float, BeforeValidator(_exact_float)]
Fraction = Annotated[float, BeforeValidator(_exact_float), Field(ge=0.0, le=1.0)]
Placement = Annotated[str, AfterValidator(_placement)]


class SMPConfig(BaseModel):
    """The resolved SMP v1 configuration; attribute names are SMP's key names (internal ones minus the `_`)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, populate_by_name=True, use_attribute_docstrings=True
    )

    pipeline_parallel_degree: PosInt = 1
    """Number of pipeline stages (alias `partitions`)."""
    tensor_parallel_degree: PosInt = 1
    """Tensor-parallel group size."""
    microbatches: PosInt = 1
    """Microbatches each `smp.step` batch is split into."""
    pipeline: Literal["simple", "interleaved", "_only_forward"] = "interleaved"
    """Pipeline schedule: all forwards first ("simple") or backward-first ("interleaved")."""
    optimize: Literal["speed", "memory"] = "speed"
    """Trade-off for tensor-parallel transformer layers (SMP's code default, not its docs' "memory")."""
    placement_strategy: Placement = "cluster"
    """Rank layout: "cluster" (=DPT), "spread" (=TPD) or a permutation of D, P, T."""
    auto_partition: bool = True
    """Partition modules automatically; False needs `default_partition`."""
    default_partition: NonNegInt | None = None
    """Stage for modules outside any `smp.partition` context (required when auto_partition is False)."""
    memory_weight: Fraction = 0.8
    """Weight of memory against compute in the auto-partition cost."""
    active_microbatches: PosInt | None = None
    """Microbatches in flight at once; resolved to an int at validation."""
    deterministic_server: bool = False
    """Serve pipeline requests in the same order on every data-parallel rank."""
    ddp: bool = False
    """Data parallelism across model replicas; required when world > pp * tp."""
    ddp_port: NonNegInt | None = None
    """Rendezvous port for torch.distributed (else MASTER_PORT, else 29760)."""
    ddp_dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; "auto" picks nccl on GPU and gloo on CPU."""
    horovod: bool = False
    """Horovod allreduce (TensorFlow-era option); incompatible with ddp."""
    contiguous: bool = True
    """Force contiguous partitions (TensorFlow only in SMP)."""
    offload_activations: bool = False
    """Move checkpointed activations to CPU."""
    activation_loading_horizon: NonNegInt = 4
    """How early offloaded activations are brought back."""
    shard_optimizer_state: bool = False
    """Shard optimizer state across data-parallel ranks (needs ddp)."""
    prescaled_batch: bool = False
    """Every rank of a tensor-parallel group gets the same batch (needs optimize="speed")."""
    skip_tracing: bool = False
    """Partition without the tracing pass."""
    fp16_params: bool = False
    """Deprecated: create tensor-parallel modules in fp16."""
    fp16: bool = False
    """fp16 model and optimizer wrappers."""
    bf16: bool = False
    """bf16 model and optimizer wrappers; excludes fp16 and fp16_params."""
    delayed_parameter_initialization: bool = False
    """Allocate parameters only after partitioning."""
    sharded_data_parallel_degree: PosInt = 1
    """Sharded data parallelism (ZeRO-3 style) group size."""
    sdp_reduce_bucket_size: int = 500_000_000
    """Sharded-DP gradient bucket size, in elements."""
    sdp_param_persistence_threshold: int = 1_000_000
    """Sharded-DP: parameters smaller than this are not sharded."""
    sdp_max_live_parameters: int = 1_000_000_000
    """Sharded-DP: most gathered parameters live at once."""
    sdp_hierarchical_allgather: bool = True
    """Sharded-DP: gather within the node first."""
    sdp_gradient_clipping: ExactFloat = 1.0
    """Sharded-DP: clipping norm applied in optimizer.step()."""
    tensor_parallel_seed: NonNegInt = 0
    """Seed of the RNG used inside tensor-parallel modules."""
    static_mode: bool = False
    """Internal pipeline optimization that AWS examples pass."""
    fast_mode: bool = False
    """Internal pipeline optimization that AWS examples pass."""
    checkpoint_attentions: bool = False
    """Internal SMP key: accepted and ignored."""
    fp32_grad_accumulation: bool = Field(False, alias="_fp32_grad_accumulation")
    """Internal SMP key `_fp32_grad_accumulation`: accepted and ignored."""
    match_weights: bool = Field(False, alias="_match_weights")
    """Internal SMP key `_match_weights`: accepted and ignored."""
    shard_offloaded_activations: bool = Field(False, alias="_shard_offloaded_activations")
    """Internal SMP key `_shard_offloaded_activations`: accepted and ignored."""
    task_level_activation_loading_horizon: int | None = None
    """Internal SMP key: accepted and ignored."""
    herring: bool = False
    """Internal SMP key: accepted and ignored."""
    load_partition: bool = False
    """Internal SMP key: accepted and ignored."""
    partition_file: str | None = None
    """Internal SMP key: accepted and ignored."""
    sharded_data_parallelism_config: dict[str, Any] | None = Field(None, alias="_sharded_data_parallelism_config")
    """Internal SMP key `_sharded_data_parallelism_config`: accepted and ignored."""

    def __init__(self, **data: Any) -> None:
        """Validate, turning pydantic's report into one SMPConfigError so no raw pydantic error escapes."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SMPConfigError(_describe_validation_error(exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _resolve_aliases(cls, data: Any) -> Any:
        """Fold `partitions` into `pipeline_parallel_degree` (a conflict between the two is an error)."""
        return _canonicalize(data, "the config") if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _cross_key_rules(self) -> SMPConfig:
        """Check §1.3's rules between keys, then resolve active_microbatches and the schedule."""
        problems = _rule_problems(self)
        if problems:
            raise PydanticCustomError("smp_rules", "{problems}", {"problems": "\n".join(problems)})
        self._resolve_active_microbatches()
        return self

    def _resolve_active_microbatches(self) -> None:
        """Make active_microbatches an int; "simple" with fewer active than microbatches becomes "interleaved"."""
        active = self.active_microbatches
        if active is None:
            simple = self.pipeline == "simple"
            active = self.microbatches if simple else min(self.pipeline_parallel_degree + 2, self.microbatches)
            object.__setattr__(self, "active_microbatches", active)  # frozen model: set once, here
        elif self.pipeline == "simple" and active < self.microbatches:
            warnings.warn(
                f'pipeline "simple" runs all {self.microbatches} microbatches at once, but active_microbatches is '
                f'{active}; switching to pipeline "interleaved" as SMP v1 did. Set active_microbatches to '
                f'{self.microbatches} (or leave it out) to keep "simple".',
                UserWarning,
                stacklevel=2,
            )
            object.__setattr__(self, "pipeline", "interleaved")

    @property
    def partitions(self) -> int:
        """SMP's old name for pipeline_parallel_degree, still read by scripts and the HF Trainer."""
        return self.pipeline_parallel_degree

    @property
    def placement_order(self) -> str:
        """placement_strategy as its D/P/T letters ("cluster" -> "DPT", "spread" -> "TPD")."""
        return _PLACEMENT_NAMED.get(self.placement_strategy, self.placement_strategy)

    def not_acted_on(self) -> list[str]:
        """SMP keys the user set to a non-default value that smp_compat accepts but ignores (for one warning)."""
        fields = type(self).model_fields
        return sorted(
            _smp_key(name)
            for name in self.model_fields_set
            if _smp_key(name) in NOT_ACTED_ON and getattr(self, name) != fields[name].default
        )

    def check_world_size(self, world_size: int) -> None:
        """Check the degrees against the number of processes, as SMP did at init."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise SMPConfigError(
                f"The world size must be a positive int, got {world_size!r} ({type(world_size).__name__}); "
                "pass the number of processes in the job."
            )
        problem = _world_size_problem(self, world_size)
        if problem:
            raise SMPConfigError(problem)

    def to_dict(self) -> dict[str, object]:
        """SMP key names to resolved values, for logging and for saving the config next to checkpoints."""
        return self.model_dump(by_alias=True)


SMP_KEYS: frozenset[str] = frozenset(f.alias or n for n, f in SMPConfig.model_fields.items())
"""Every key smp_compat accepts (besides the alias `partitions`), spelled as SMP spells it."""

_INTERNAL_KEYS = frozenset(
    {
        "checkpoint_attentions",
        "_fp32_grad_accumulation",
        "_match_weights",
        "_shard_offloaded_activations",
        "task_level_activation_loading_horizon",
        "herring",
        "load_partition",
        "partition_file",
        "_sharded_data_parallelism_config",
    }
)

NOT_ACTED_ON: frozenset[str] = frozenset(
    {
        "activation_loading_horizon",
        "skip_tracing",
        "fp16_params",
        "horovod",
        "contiguous",
        "static_mode",
        "fast_mode",
    }
    | {key for key in SMP_KEYS if key.startswith("sdp_")}
    | _INTERNAL_KEYS
)
"""SMP keys accepted but not implemented yet; smp.init warns once about those set to a non-default value."""

UNSUPPORTED: dict[str, str] = {
    "sharded_data_parallel_degree": "sharded data parallelism",
}
"""SMP keys whose non-default value asks for a feature smp_compat lacks: resolve_config raises SMPUnsupportedError."""

_FIELD_BY_KEY: dict[str, str] = {f.alias or n: n for n, f in SMPConfig.model_fields.items()}


def _smp_key(name: str) -> str:
    """The SMP spelling of a field or key name (`fp32_grad_accumulation` -> `_fp32_grad_accumulation`)."""
    if name in _FIELD_BY_KEY:
        return name
    field = SMPConfig.model_fields.get(name)
    return (field.alias or name) if field is not None else name


def _canonicalize(params: Mapping[Any, Any], source: str) -> dict[str, Any]:
    """Spell every key as SMP does; two spellings of one key with different values are an error."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_key, value in params.items():
        if not isinstance(raw_key, str):
            raise SMPConfigError(
                f"Config keys must be strings, but {source} has the key {raw_key!r} ({type(raw_key).__name__}); "
                "use SMP's key names such as 'pipeline_parallel_degree'."
            )
        key = _ALIASES.get(raw_key, _smp_key(raw_key))
        if key in out and out[key] != value:
            raise SMPConfigError(
                f"{source} gives both {spelled[key]!r} ({out[key]!r}) and {raw_key!r} ({value!r}), two names for "
                f"the same key {key!r}, with different values; keep only one of them."
            )
        if key not in out or raw_key == key:
            out[key], spelled[key] = value, raw_key
    return out


def _rule_problems(cfg: SMPConfig) -> list[str]:
    """Every broken cross-key rule of §1.3, one message each (rules apply when the dependent key is non-default)."""
    problems = _ddp_problems(cfg) + _precision_problems(cfg) + _sdp_problems(cfg) + _partition_problems(cfg)
    if cfg.active_microbatches is not None and cfg.active_microbatches > cfg.microbatches:
        problems.append(
            f"active_microbatches ({cfg.active_microbatches}) cannot exceed microbatches ({cfg.microbatches}); "
            "lower it or leave it out (it then defaults to min(pipeline_parallel_degree + 2, microbatches))."
        )
    return problems


def _ddp_problems(cfg: SMPConfig) -> list[str]:
    """Rules for keys that need (or exclude) ddp."""
    needs_ddp = [
        ("tensor_parallel_degree", cfg.tensor_parallel_degree, cfg.tensor_parallel_degree > 1),
        ("ddp_port", cfg.ddp_port, cfg.ddp_port is not None),
        ("ddp_dist_backend", cfg.ddp_dist_backend, cfg.ddp_dist_backend != "auto"),
        ("shard_optimizer_state", cfg.shard_optimizer_state, cfg.shard_optimizer_state),
    ]
    problems = [
        f'{key} ({value!r}) needs "ddp": True, but ddp is False; add "ddp": True or reset {key} to its default.'
        for key, value, applies in needs_ddp
        if applies and not cfg.ddp
    ]
    if cfg.ddp and cfg.horovod:
        problems.append('"ddp": True and "horovod": True cannot be combined; set "horovod": False on PyTorch.')
    return problems


def _precision_problems(cfg: SMPConfig) -> list[str]:
    """Rules for prescaled_batch and the half-precision switches."""
    problems = []
    if cfg.prescaled_batch and cfg.optimize != "speed":
        problems.append(
            f'prescaled_batch: True needs optimize "speed", got "{cfg.optimize}"; set "optimize": "speed".'
        )
    if cfg.bf16 and (cfg.fp16 or cfg.fp16_params):
        problems.append(
            f"bf16: True cannot be combined with fp16 ({cfg.fp16}) or fp16_params ({cfg.fp16_params}); "
            "pick one precision and set the others to False."
        )
    return problems


def _sdp_problems(cfg: SMPConfig) -> list[str]:
    """Sharded data parallelism excludes tensor and pipeline parallelism and optimizer-state sharding."""
    sdp = cfg.sharded_data_parallel_degree
    if sdp == 1:
        return []
    clashes = [
        ("tensor_parallel_degree", cfg.tensor_parallel_degree, cfg.tensor_parallel_degree != 1, 1),
        ("pipeline_parallel_degree", cfg.pipeline_parallel_degree, cfg.pipeline_parallel_degree != 1, 1),
        ("shard_optimizer_state", cfg.shard_optimizer_state, cfg.shard_optimizer_state, False),
    ]
    return [
        f"sharded_data_parallel_degree ({sdp}) > 1 cannot be combined with {key} ({value!r}); set {key} "
        f"to {fix!r} or sharded_data_parallel_degree to 1."
        for key, value, clash, fix in clashes
        if clash
    ]


def _partition_problems(cfg: SMPConfig) -> list[str]:
    """Manual partitioning needs a default stage, and that stage must exist."""
    pp = cfg.pipeline_parallel_degree
    if not cfg.auto_partition and cfg.default_partition is None:
        return [
            'auto_partition: False needs default_partition (the stage of modules outside smp.partition), but it '
            f'is not set; add e.g. "default_partition": 0 (0 .. {pp - 1}).'
        ]
    if cfg.default_partition is not None and cfg.default_partition >= pp:
        return [
            f"default_partition ({cfg.default_partition}) must be < pipeline_parallel_degree ({pp}); "
            f"pick a stage in 0 .. {pp - 1}."
        ]
    return []


def _world_size_problem(cfg: SMPConfig, world: int) -> str | None:
    """The first world-size rule the config breaks, as a message, or None."""
    pp, tp = cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree
    degrees = f"pipeline_parallel_degree ({pp}) x tensor_parallel_degree ({tp})"
    if world < pp * tp:
        return (
            f"{degrees} = {pp * tp} processes per model replica, but the world size is only {world}; "
            f"launch a multiple of {pp * tp} processes or lower the degrees."
        )
    if world % (pp * tp):
        return (
            f"{degrees} must divide the world size ({world}); launch a multiple of {pp * tp} processes "
            f"or choose degrees whose product divides {world}."
        )
    if world > pp * tp and not cfg.ddp:
        return (
            f"The world size ({world}) is larger than {degrees} = {pp * tp}, so the job holds "
            f'{world // (pp * tp)} model replicas, which needs data parallelism; set "ddp": True, as SMP requires.'
        )
    return None


def _describe_validation_error(exc: ValidationError) -> str:
    """One SMPConfigError message for all of pydantic's errors: one line per problem, by SMP key name."""
    lines = [line for err in exc.errors() for line in _describe_error(err).splitlines()]
    plural = "s" if len(lines) > 1 else ""
    header = f"Invalid SMP configuration ({len(lines)} problem{plural}):"
    return "\n".join([header, *(f"  - {line}" for line in lines)])


def _describe_error(err: ErrorDetails) -> str:
    """Translate one pydantic error into our wording: key, value seen, expected, what to do."""
    ctx = err.get("ctx") or {}
    kind, value = err["type"], err.get("input")
    if not err["loc"]:  # model-level: our rules, or the alias conflict raised before field validation
        return str(ctx.get("problems") or ctx.get("error") or err["msg"])
    key = _smp_key(str(err["loc"][0])) + "".join(f"[{part!r}]" for part in err["loc"][1:] if part != "[key]")
    if kind == "extra_forbidden":
        return _unknown_key_message(key, value)
    seen = f"got {value!r} ({type(value).__name__})"
    if kind in _TYPE_WORDS:
        return f"{key}: expected {_TYPE_WORDS[kind]}, {seen}{_type_hint(kind, value)}."
    if kind == "literal_error":
        return f"{key}: expected one of {ctx.get('expected')}, {seen}{_case_hint(value)}."
    if kind == "placement":
        return (
            f'{key}: expected "cluster", "spread" or a permutation of the upper-case letters D, P, T '
            f'(e.g. "DPT", "TPD"), {seen}{_case_hint(value)}.'
        )
    if kind in _BOUND_WORDS:
        bound = next(iter(ctx.values()), "?")
        return f"{key}: must be {_BOUND_WORDS[kind]} {bound}, {seen}; change the value."
    return f"{key}: {err['msg']}, {seen}."


_TYPE_WORDS = {
    "int_type": "an int",
    "bool_type": "a bool (true or false)",
    "string_type": "a string",
    "float_type": "a float",
    "float_exact": "a float",
    "dict_type": "a dict",
}
_BOUND_WORDS = {
    "greater_than_equal": ">=",
    "less_than_equal": "<=",
    "greater_than": ">",
    "less_than": "<",
}


def _type_hint(kind: str, value: Any) -> str:
    """A suggestion for the usual type mistakes (types are strict, as in SMP v1)."""
    if kind == "float_exact":
        example = "a float such as 1.0" if isinstance(value, bool) else f"{value}.0"
        return f"; write {example} (SMP v1 also rejected an int for a float key)"
    if kind == "bool_type" and isinstance(value, str | int):
        return "; write true/false without quotes in JSON (True/False in Python)"
    if kind in ("int_type", "float_type") and isinstance(value, str):
        return "; write the number without quotes"
    if kind == "int_type" and isinstance(value, float):
        return "; write a whole number without a decimal point"
    return ""


def _case_hint(value: Any) -> str:
    """Point out a value that is right except for its case (values are case-sensitive)."""
    if not isinstance(value, str):
        return ""
    known = {"simple", "interleaved", "speed", "memory", "auto", "nccl", "gloo", "cluster", "spread"}
    fixed = value.lower() if value.lower() in known else value.upper()
    if fixed != value and (fixed in known or fixed in _PLACEMENT_PERMUTATIONS):
        return f'; values are case-sensitive, write "{fixed}"'
    return ""


def _unknown_key_message(key: str, value: Any) -> str:
    """Name the unknown key and the closest valid ones."""
    candidates = sorted(SMP_KEYS | set(_ALIASES))
    close = difflib.get_close_matches(key.lower(), candidates, n=3, cutoff=0.6)
    guess = ("did you mean " + " or ".join(f'"{c}"' for c in close) + "?") if close else "no valid key is close."
    return f'unknown key "{key}" (value {value!r}); {guess} SMP v1 rejects unknown keys too; {_DOCS_HINT}.'


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
        return _canonicalize(extract_mp_parameters(parse_json(text, f"the config file {str(path)!r}")), str(path))
    return _canonicalize(extract_mp_parameters(config), "the config passed to smp.init()")


def _load_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The parameters in SM_HP_MP_PARAMETERS (empty when unset or blank)."""
    raw = environ.get(ENV_VAR, "")
    if not raw.strip():
        return {}
    return _canonicalize(extract_mp_parameters(parse_json(raw, ENV_VAR)), ENV_VAR)


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
        default = SMPConfig.model_fields[_FIELD_BY_KEY[key]].default
        if key in params and _is_non_default(params[key], default):
            raise SMPUnsupportedError(
                f"{key}={params[key]!r} asks for {feature}, which smp_compat does not implement yet; set "
                f'"{key}": {default!r} (or remove the key) to run without it.'
            )
    tp, pp = params.get("tensor_parallel_degree", 1), params.get("pipeline_parallel_degree", params.get("partitions", 1))
    if _is_non_default(tp, 1) and params.get("shard_optimizer_state") is True:
        raise SMPUnsupportedError(
            f"tensor_parallel_degree={tp!r} with shard_optimizer_state=True (optimizer-state sharding over the rdp "
            "group) is not implemented yet; set shard_optimizer_state to False."
        )
    if _is_non_default(tp, 1) and _is_non_default(pp, 1):
        raise SMPUnsupportedError(
            f"tensor_parallel_degree={tp!r} with pipeline_parallel_degree={pp!r} (tensor parallelism combined with "
            "pipeline parallelism) is not implemented yet; use one of them (tp x rdp or pp x dp)."
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
