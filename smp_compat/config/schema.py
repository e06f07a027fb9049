"""``SMPConfig``: every SMP v1 key with its strict type and default, aliases, and our wording of validation errors."""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic import TypeAdapter
from pydantic_core import ErrorDetails, PydanticCustomError

from smp_compat.config.rules import rule_problems, world_size_problem
from smp_compat.errors import SMPConfigError

__all__ = [
    "ENV_VAR",
    "NOT_ACTED_ON",
    "SMP_KEYS",
    "SMPConfig",
    "UNSUPPORTED",
    "FIELD_BY_KEY",
    "canonical_key",
    "canonicalize",
    "value_problem",
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
    """Shard optimizer state across the ranks holding the same parameters (the rdp group; needs ddp)."""
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
        return canonicalize(data, "the config") if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _cross_key_rules(self) -> SMPConfig:
        """Check §1.3's rules between keys, then resolve active_microbatches and the schedule."""
        problems = rule_problems(self)
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
        """SMP keys the user set to a non-default value that smp_compat accepts but ignores (for one warning).

        Keys that SMP ignored too under this config (``prescaled_batch`` at tensor_parallel_degree 1) are left
        out: see ``inert_keys``.
        """
        fields = type(self).model_fields
        inert = set(self.inert_keys())
        return sorted(
            _smp_key(name)
            for name in self.model_fields_set
            if _smp_key(name) in NOT_ACTED_ON and getattr(self, name) != fields[name].default
            and _smp_key(name) not in inert
        )  # fmt: skip

    def inert_keys(self) -> list[str]:
        """Keys set to a non-default value that change nothing under this config, in SMP as here (logged at debug).

        ``prescaled_batch`` at tp 1 (no tp group shares a batch); ``skip_tracing`` at pp 1 (SMP's trace fed only
        the pipeline partitioner); the ``sdp_*`` tuning keys at sharded_data_parallel_degree 1 (nothing is
        sharded); ``sdp_hierarchical_allgather: False`` (a flat all-gather, which is what FSDP2 does);
        ``activation_loading_horizon`` without ``offload_activations`` (nothing is offloaded).
        """
        inert = set()
        if self.tensor_parallel_degree == 1:
            inert.add("prescaled_batch")
        if self.pipeline_parallel_degree == 1:
            inert.add("skip_tracing")
        if self.sharded_data_parallel_degree == 1:
            inert |= _SDP_TUNING_KEYS
        if not self.sdp_hierarchical_allgather:
            inert.add("sdp_hierarchical_allgather")
        if not self.offload_activations:
            inert.add("activation_loading_horizon")
        fields = type(self).model_fields
        return sorted(
            _smp_key(name) for name, field in fields.items()
            if _smp_key(name) in inert and getattr(self, name) != field.default
        )  # fmt: skip

    def check_world_size(self, world_size: int) -> None:
        """Check the degrees against the number of processes, as SMP did at init."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise SMPConfigError(
                f"The world size must be a positive int, got {world_size!r} ({type(world_size).__name__}); "
                "pass the number of processes in the job."
            )
        problem = world_size_problem(self, world_size)
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

_SDP_TUNING_KEYS = frozenset(
    {"sdp_reduce_bucket_size", "sdp_param_persistence_threshold", "sdp_max_live_parameters",
     "sdp_hierarchical_allgather"}
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
    | _SDP_TUNING_KEYS  # FSDP2 has no such knob: see docs/differences.md
    | _INTERNAL_KEYS
)
"""SMP keys accepted but not implemented yet; smp.init warns once about those set to a non-default value."""

UNSUPPORTED: dict[str, str] = {
}
"""SMP keys whose non-default value asks for a feature smp_compat lacks: resolve_config raises SMPUnsupportedError."""

FIELD_BY_KEY: dict[str, str] = {f.alias or n: n for n, f in SMPConfig.model_fields.items()}


def _smp_key(name: str) -> str:
    """The SMP spelling of a field or key name (`fp32_grad_accumulation` -> `_fp32_grad_accumulation`)."""
    if name in FIELD_BY_KEY:
        return name
    field = SMPConfig.model_fields.get(name)
    return (field.alias or name) if field is not None else name


def canonicalize(params: Mapping[Any, Any], source: str) -> dict[str, Any]:
    """Spell every key as SMP does; two spellings of one key with different values are an error."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_key, value in params.items():
        if not isinstance(raw_key, str):
            raise SMPConfigError(
                f"Config keys must be strings, but {source} has the key {raw_key!r} ({type(raw_key).__name__}); "
                "use SMP's key names such as 'pipeline_parallel_degree'."
            )
        key = canonical_key(raw_key)
        if key in out and out[key] != value:
            raise SMPConfigError(
                f"{source} gives both {spelled[key]!r} ({out[key]!r}) and {raw_key!r} ({value!r}), two names for "
                f"the same key {key!r}, with different values; keep only one of them."
            )
        if key not in out or raw_key == key:
            out[key], spelled[key] = value, raw_key
    return out


def canonical_key(raw_key: str) -> str:
    """The SMP spelling of a key or alias (`partitions` -> `pipeline_parallel_degree`); unknown keys unchanged."""
    return _ALIASES.get(raw_key, _smp_key(raw_key))


def value_problem(key: str, value: Any) -> str | None:
    """What smp.init says about ``key: value`` on its own (type, choices, bounds), or None when it accepts it.

    The field's own validation from SMPConfig (same type, validators and bounds, strict), for one key (an alias
    is fine); unknown keys and the cross-key rules (``rules.rule_problems``) are left out, so a static checker
    that knows only some values can use it.
    """
    field = FIELD_BY_KEY.get(canonical_key(key))
    if field is None:
        return None
    try:
        _field_adapter(field).validate_python(value)
    except ValidationError as exc:
        errors = [{**err, "loc": (field, *err["loc"])} for err in exc.errors()]
        return "\n".join(_describe_error(err) for err in errors)  # type: ignore[arg-type]
    return None


@functools.cache
def _field_adapter(name: str) -> TypeAdapter[Any]:
    info = SMPConfig.model_fields[name]
    kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation  # 3.10 syntax
    return TypeAdapter(kind, config=ConfigDict(strict=True))


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
