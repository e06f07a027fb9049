"""Tests for smp_compat.config: keys, types, aliases, sources, cross-key rules and world-size checks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from smp_compat.config import (
    NOT_ACTED_ON,
    SMP_KEYS,
    UNSUPPORTED,
    SMPConfig,
    extract_mp_parameters,
    resolve_config,
)
from smp_compat.config.schema import FIELD_BY_KEY
from smp_compat.errors import SMPConfigError

__all__: list[str] = []

NO_ENV: dict[str, str] = {}


def resolve(config: Any = None, **env_params: Any) -> SMPConfig:
    """resolve_config with a private environment (never the real os.environ)."""
    environ = {"SM_HP_MP_PARAMETERS": json.dumps(env_params)} if env_params else {}
    return resolve_config(config, environ=environ)


def config_error(params: dict[str, Any]) -> str:
    """The message of the SMPConfigError that these parameters raise."""
    with pytest.raises(SMPConfigError) as info:
        resolve_config(params, environ=NO_ENV)
    return str(info.value)


# --- defaults ---------------------------------------------------------------------------------------------


def test_defaults_follow_the_shipped_library() -> None:
    cfg = resolve()
    assert cfg.pipeline_parallel_degree == 1 and cfg.partitions == 1
    assert cfg.tensor_parallel_degree == 1 and cfg.microbatches == 1
    assert (cfg.pipeline, cfg.optimize, cfg.placement_strategy) == ("interleaved", "speed", "cluster")
    assert cfg.auto_partition is True and cfg.default_partition is None
    assert cfg.memory_weight == 0.8 and cfg.active_microbatches == 1
    assert (cfg.ddp, cfg.ddp_port, cfg.ddp_dist_backend, cfg.horovod) == (False, None, "auto", False)
    assert cfg.contiguous is True and cfg.activation_loading_horizon == 4
    assert cfg.sdp_reduce_bucket_size == 500_000_000 and cfg.sdp_gradient_clipping == 1.0
    assert cfg.sdp_hierarchical_allgather is True and cfg.tensor_parallel_seed == 0
    assert cfg.not_acted_on() == []


def test_config_is_frozen() -> None:
    cfg = resolve()
    with pytest.raises(Exception):
        cfg.microbatches = 4  # type: ignore[misc]
    assert cfg.microbatches == 1


def test_placement_order() -> None:
    assert resolve().placement_order == "DPT"
    assert resolve({"placement_strategy": "spread"}).placement_order == "TPD"
    assert resolve({"placement_strategy": "PDT"}).placement_order == "PDT"


# --- alias ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["partitions", "pipeline_parallel_degree"])
def test_alias_both_ways(key: str) -> None:
    cfg = resolve({key: 2})
    assert cfg.pipeline_parallel_degree == 2 and cfg.partitions == 2
    assert "partitions" not in cfg.to_dict()


def test_alias_and_name_with_same_value_is_fine() -> None:
    assert resolve({"partitions": 2, "pipeline_parallel_degree": 2}).pipeline_parallel_degree == 2


def test_alias_and_name_with_different_values_is_an_error() -> None:
    message = config_error({"partitions": 2, "pipeline_parallel_degree": 3})
    assert "'partitions' (2)" in message and "'pipeline_parallel_degree' (3)" in message
    with pytest.raises(SMPConfigError, match="different values"):
        SMPConfig(partitions=2, pipeline_parallel_degree=3)


def test_env_alias_overrides_canonical_key_from_dict() -> None:
    """HF's SMP path needs "partitions" in the env while scripts pass pipeline_parallel_degree: env wins."""
    cfg = resolve({"pipeline_parallel_degree": 2, "microbatches": 4}, partitions=4)
    assert cfg.pipeline_parallel_degree == 4 and cfg.microbatches == 4


# --- sources ----------------------------------------------------------------------------------------------


def test_env_overrides_dict_key_by_key() -> None:
    cfg = resolve({"microbatches": 4, "pipeline": "simple", "ddp": True}, microbatches=8, ddp=False)
    assert (cfg.microbatches, cfg.pipeline, cfg.ddp) == (8, "simple", False)


def test_env_alone_and_blank_env() -> None:
    assert resolve(None, microbatches=3).microbatches == 3
    assert resolve_config({"microbatches": 2}, environ={"SM_HP_MP_PARAMETERS": "  "}).microbatches == 2


def test_environ_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", '{"microbatches": 5}')
    assert resolve_config({"microbatches": 2}).microbatches == 5


def test_bad_env_json_names_the_variable() -> None:
    with pytest.raises(SMPConfigError, match="SM_HP_MP_PARAMETERS is not valid JSON"):
        resolve_config({}, environ={"SM_HP_MP_PARAMETERS": "{'microbatches': 2}"})


def test_error_from_env_value_says_it_came_from_env() -> None:
    with pytest.raises(SMPConfigError, match=r"(?s)microbatches.*taken from SM_HP_MP_PARAMETERS"):
        resolve({"microbatches": 2}, microbatches=0)


def test_file_source(tmp_path: Path) -> None:
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"partitions": 2, "microbatches": 4, "ddp": True}))
    for source in (path, str(path)):
        cfg = resolve_config(source, environ=NO_ENV)
        assert (cfg.pipeline_parallel_degree, cfg.microbatches, cfg.ddp) == (2, 4, True)
    assert resolve(path, microbatches=8).microbatches == 8


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"microbatches": 2,}')
    with pytest.raises(SMPConfigError, match=r"config file .*bad\.json.* is not valid JSON"):
        resolve_config(bad, environ=NO_ENV)
    with pytest.raises(SMPConfigError, match="Cannot read the SMP config file"):
        resolve_config(tmp_path / "missing.json", environ=NO_ENV)


def test_non_dict_config_is_an_error() -> None:
    with pytest.raises(SMPConfigError, match="must be a dict, got list"):
        resolve_config([("microbatches", 2)], environ=NO_ENV)  # type: ignore[arg-type]
    with pytest.raises(SMPConfigError, match="keys must be strings"):
        resolve_config({1: 2}, environ=NO_ENV)


# --- distribution-dict shapes ---------------------------------------------------------------------------

PARAMS = {"partitions": 2, "microbatches": 4}


@pytest.mark.parametrize(
    "shape",
    [
        {"smdistributed": {"modelparallel": {"enabled": True, "parameters": PARAMS}}, "mpi": {"enabled": True}},
        {"modelparallel": {"enabled": True, "parameters": PARAMS}},
        {"modelparallel": {"parameters": PARAMS}},
        PARAMS,
    ],
)
def test_distribution_shapes(shape: dict[str, Any], tmp_path: Path) -> None:
    assert extract_mp_parameters(shape) == PARAMS
    assert resolve(shape).pipeline_parallel_degree == 2
    path = tmp_path / "distribution.json"
    path.write_text(json.dumps(shape))
    assert resolve(path).microbatches == 4


def test_disabled_modelparallel_is_an_error() -> None:
    with pytest.raises(SMPConfigError, match='"enabled": False'):
        extract_mp_parameters({"smdistributed": {"modelparallel": {"enabled": False, "parameters": PARAMS}}})


@pytest.mark.parametrize(
    "shape",
    [
        {"smdistributed": {"dataparallel": {"enabled": True}}},
        {"modelparallel": {"enabled": True, "microbatches": 4}},
        {"modelparallel": {"enabled": True, "parameters": "smp.json"}},
    ],
)
def test_malformed_distribution_shapes(shape: dict[str, Any]) -> None:
    with pytest.raises(SMPConfigError):
        extract_mp_parameters(shape)


# --- unknown keys and types -----------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest() -> None:
    message = config_error({"microbatch": 4})
    assert 'unknown key "microbatch"' in message and 'did you mean "microbatches"' in message
    assert "SMP_KEYS" in message  # says where the valid keys are listed


def test_unknown_key_without_close_match() -> None:
    assert "no valid key is close" in config_error({"zzz_qqq": 1})


def test_int_for_float_fails_and_suggests_a_float() -> None:
    message = config_error({"memory_weight": 1})
    assert "memory_weight: expected a float, got 1 (int)" in message and "write 1.0" in message
    assert "got True (bool)" in config_error({"sdp_gradient_clipping": True})
    assert resolve({"memory_weight": 1.0}).memory_weight == 1.0


def test_str_for_int_fails() -> None:
    message = config_error({"microbatches": "4"})
    assert "microbatches: expected an int, got '4' (str)" in message and "without quotes" in message
    assert "got 4.0 (float)" in config_error({"microbatches": 4.0})
    assert "got True (bool)" in config_error({"pipeline_parallel_degree": True})


def test_str_for_bool_fails() -> None:
    message = config_error({"ddp": "true"})
    assert "ddp: expected a bool (true or false), got 'true' (str)" in message
    assert "got 1 (int)" in config_error({"auto_partition": 1})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("pipeline", "gpipe", "'simple', 'interleaved' or '_only_forward'"),
        ("pipeline", "Simple", 'case-sensitive, write "simple"'),
        ("optimize", "fast", "'speed' or 'memory'"),
        ("ddp_dist_backend", "mpi", "'auto', 'nccl' or 'gloo'"),
        ("placement_strategy", "dpt", 'write "DPT"'),
        ("placement_strategy", "CLUSTER", 'write "cluster"'),
        ("placement_strategy", "DDP", "permutation of the upper-case letters D, P, T"),
        ("partition_file", 3, "expected a string"),
        ("_sharded_data_parallelism_config", [1], "expected a dict"),
    ],
)
def test_enum_and_other_type_errors(key: str, value: Any, expected: str) -> None:
    message = config_error({key: value})
    assert expected in message and message.count("\n  - ") == 1


@pytest.mark.parametrize("value", ["cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"])
def test_placement_values_accepted(value: str) -> None:
    assert resolve({"placement_strategy": value}).placement_strategy == value


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("pipeline_parallel_degree", 0, ">= 1"),
        ("microbatches", -1, ">= 1"),
        ("active_microbatches", 0, ">= 1"),
        ("memory_weight", 1.5, "<= 1.0"),
        ("memory_weight", -0.1, ">= 0.0"),
        ("ddp_port", -1, ">= 0"),
        ("activation_loading_horizon", -1, ">= 0"),
        ("tensor_parallel_seed", -5, ">= 0"),
        ("default_partition", -1, ">= 0"),
    ],
)
def test_bounds(key: str, value: Any, bound: str) -> None:
    assert f"{key}: must be {bound}, got {value!r}" in config_error({key: value})


def test_all_problems_in_one_error_by_smp_name() -> None:
    message = config_error({"microbatches": "2", "ddp": "yes", "micro_batches": 2, "_match_weights": "x"})
    lines = message.splitlines()
    assert lines[0] == "Invalid SMP configuration (4 problems):" and len(lines) == 5
    assert any(line.startswith("  - _match_weights:") for line in lines)
    assert "pydantic" not in message and "validation error" not in message.lower()


def test_direct_construction_raises_smp_config_error() -> None:
    with pytest.raises(SMPConfigError, match="memory_weight"):
        SMPConfig(memory_weight=1)
    with pytest.raises(SMPConfigError, match='unknown key "foo"'):
        SMPConfig(foo=1)


# --- internal keys ----------------------------------------------------------------------------------------

INTERNAL = {
    "checkpoint_attentions": True,
    "_fp32_grad_accumulation": True,
    "_match_weights": True,
    "_shard_offloaded_activations": True,
    "task_level_activation_loading_horizon": 2,
    "herring": True,
    "load_partition": True,
    "partition_file": "partition.json",
    "_sharded_data_parallelism_config": {"a": 1},
}


def test_internal_keys_accepted_and_reported_as_not_acted_on() -> None:
    cfg = resolve(INTERNAL)
    assert cfg.fp32_grad_accumulation is True and cfg.sharded_data_parallelism_config == {"a": 1}
    assert cfg.to_dict()["_fp32_grad_accumulation"] is True
    assert cfg.not_acted_on() == sorted(INTERNAL)


def test_internal_field_names_also_work() -> None:
    assert resolve({"fp32_grad_accumulation": True}).not_acted_on() == ["_fp32_grad_accumulation"]


# --- cross-key rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"tensor_parallel_degree": 2}, 'tensor_parallel_degree (2) needs "ddp": True'),
        ({"ddp": True, "horovod": True}, "cannot be combined"),
        ({"ddp_port": 29500}, 'ddp_port (29500) needs "ddp": True'),
        ({"ddp_dist_backend": "gloo"}, "ddp_dist_backend ('gloo') needs \"ddp\": True"),
        ({"prescaled_batch": True, "optimize": "memory"}, 'needs optimize "speed", got "memory"'),
        ({"bf16": True, "fp16": True}, "bf16: True cannot be combined"),
        ({"bf16": True, "fp16_params": True}, "fp16_params (True)"),
        ({"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2}, "pipeline_parallel_degree (2)"),
        ({"sharded_data_parallel_degree": 2, "shard_optimizer_state": True, "ddp": True}, "shard_optimizer_state"),
        ({"shard_optimizer_state": True}, 'shard_optimizer_state (True) needs "ddp": True'),
        ({"auto_partition": False}, "auto_partition: False needs default_partition"),
        ({"pipeline_parallel_degree": 2, "default_partition": 2}, "default_partition (2) must be < pipeline"),
        ({"microbatches": 2, "active_microbatches": 3}, "active_microbatches (3) cannot exceed microbatches (2)"),
    ],
)
def test_cross_key_rules(params: dict[str, Any], expected: str) -> None:
    with pytest.raises(SMPConfigError) as info:
        SMPConfig(**params)  # direct: resolve_config would refuse the unsupported keys first
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "params",
    [
        {"ddp": True, "ddp_port": 29500, "ddp_dist_backend": "nccl", "shard_optimizer_state": True},
        {"tensor_parallel_degree": 2, "ddp": True},
        {"horovod": True},
        {"prescaled_batch": True, "optimize": "speed"},
        {"bf16": True},
        {"fp16": True, "fp16_params": True},
        {"sharded_data_parallel_degree": 2, "ddp": True},
        {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True},  # SMP 1.15 allows it
        {"auto_partition": False, "default_partition": 1, "pipeline_parallel_degree": 2},
        {"auto_partition": True, "default_partition": 0},
    ],
)
def test_cross_key_rules_hold(params: dict[str, Any]) -> None:
    SMPConfig(**params)


def test_rules_are_reported_together() -> None:
    with pytest.raises(SMPConfigError) as info:
        SMPConfig(bf16=True, fp16=True, ddp_port=1, auto_partition=False)
    assert str(info.value).startswith("Invalid SMP configuration (3 problems):")


# --- world size ---------------------------------------------------------------------------------------------


def test_world_size_ok() -> None:
    resolve({"partitions": 2}).check_world_size(2)
    resolve({"partitions": 2, "ddp": True}).check_world_size(8)
    SMPConfig(pipeline_parallel_degree=2, tensor_parallel_degree=2, ddp=True).check_world_size(4)


def test_world_size_too_small() -> None:
    with pytest.raises(SMPConfigError, match=r"= 4 processes per model replica, but the world size is only 2"):
        resolve({"partitions": 4, "ddp": True}).check_world_size(2)


def test_world_size_not_divisible() -> None:
    expected = r"pipeline_parallel_degree \(3\) x tensor_parallel_degree \(1\) must divide the world size \(8\)"
    with pytest.raises(SMPConfigError, match=expected):
        resolve({"partitions": 3, "ddp": True}).check_world_size(8)


def test_world_size_larger_needs_ddp() -> None:
    with pytest.raises(SMPConfigError, match=r'4 model replicas.*set "ddp": True, as SMP requires'):
        resolve({"partitions": 2}).check_world_size(8)


@pytest.mark.parametrize("world", [0, -1, 2.0, True])
def test_world_size_must_be_a_positive_int(world: Any) -> None:
    with pytest.raises(SMPConfigError, match="positive int"):
        resolve().check_world_size(world)


# --- active_microbatches and the schedule -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "active"),
    [
        ({}, 1),
        ({"microbatches": 8}, 3),
        ({"microbatches": 8, "partitions": 2}, 4),
        ({"microbatches": 3, "partitions": 4}, 3),
        ({"microbatches": 8, "pipeline": "simple"}, 8),
        ({"microbatches": 8, "pipeline": "_only_forward"}, 3),
        ({"microbatches": 8, "active_microbatches": 5}, 5),
    ],
)
def test_active_microbatches_derivation(params: dict[str, Any], active: int) -> None:
    cfg = resolve(params)
    assert cfg.active_microbatches == active
    assert cfg.pipeline == params.get("pipeline", "interleaved")


def test_simple_with_fewer_active_switches_to_interleaved() -> None:
    with pytest.warns(UserWarning, match='switching to pipeline "interleaved"') as record:
        cfg = resolve({"pipeline": "simple", "microbatches": 8, "active_microbatches": 4})
    assert len(record) == 1
    assert (cfg.pipeline, cfg.active_microbatches) == ("interleaved", 4)


def test_simple_with_all_active_stays_simple() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = resolve({"pipeline": "simple", "microbatches": 8, "active_microbatches": 8})
    assert cfg.pipeline == "simple"


# --- not acted on, unsupported -----------------------------------------------------------------------------


def test_not_acted_on_lists_explicit_non_default_keys_sorted() -> None:
    cfg = resolve({"skip_tracing": True, "optimize": "memory", "contiguous": True, "sdp_max_live_parameters": 5,
                   "ddp": True, "fp16": True, "pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 1,
                   "fp16_params": False})  # fmt: skip
    assert cfg.not_acted_on() == ["skip_tracing"]  # optimize: acted on (tp); sdp 1: sdp_max_live_parameters inert


def test_keys_that_change_nothing_under_this_config_do_not_warn() -> None:
    """AWS's sharded-DP notebooks (issue 26): skip_tracing at pp 1 and a flat all-gather change nothing in SMP
    either, so they are only logged at debug level; the same keys warn where SMP would have acted on them."""
    notebook = {"ddp": True, "skip_tracing": True, "delayed_parameter_initialization": True, "bf16": True,
                "sharded_data_parallel_degree": 8, "sdp_hierarchical_allgather": False, "sdp_gradient_clipping": 1.0,
                "sdp_reduce_bucket_size": int(5e8), "sdp_param_persistence_threshold": int(1e6),
                "sdp_max_live_parameters": int(1e9), "activation_loading_horizon": 2, "prescaled_batch": True}
    cfg = resolve(notebook)
    assert cfg.not_acted_on() == []
    assert cfg.inert_keys() == ["activation_loading_horizon", "prescaled_batch", "sdp_hierarchical_allgather",
                                "skip_tracing"]  # fmt: skip
    assert resolve({**notebook, "sharded_data_parallel_degree": 1, "sdp_max_live_parameters": 5}).not_acted_on() == []
    acted = resolve({**notebook, "sdp_max_live_parameters": 5, "pipeline_parallel_degree": 2,
                     "sharded_data_parallel_degree": 1, "bf16": False, "offload_activations": True})  # fmt: skip
    assert acted.not_acted_on() == ["activation_loading_horizon", "skip_tracing"]  # sdp 1: the sdp keys stay inert
    assert resolve({**notebook, "sdp_max_live_parameters": 5}).not_acted_on() == ["sdp_max_live_parameters"]


def test_not_acted_on_contents() -> None:
    assert {"_match_weights", "sdp_max_live_parameters"} <= NOT_ACTED_ON
    assert not NOT_ACTED_ON & {"optimize", "prescaled_batch", "tensor_parallel_seed"}  # tensor parallelism
    assert not NOT_ACTED_ON & {"fp16", "bf16", "shard_optimizer_state", "delayed_parameter_initialization"}
    assert NOT_ACTED_ON <= SMP_KEYS
    assert not NOT_ACTED_ON & {"pipeline_parallel_degree", "microbatches", "pipeline", "ddp", "active_microbatches"}


@pytest.mark.parametrize(
    "params",
    [
        {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2},
        {"tensor_parallel_degree": 2, "shard_optimizer_state": True},
        {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
    ],
)
def test_tensor_parallel_combinations_are_accepted(params: dict[str, Any]) -> None:
    assert not UNSUPPORTED  # every key's own feature exists, and so does every combination SMP allowed
    cfg = resolve({"ddp": True, **params})
    assert all(getattr(cfg, FIELD_BY_KEY[k]) == v for k, v in params.items())


# --- round trip ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"partitions": 2, "microbatches": 8, "ddp": True, "ddp_port": 1234, "placement_strategy": "spread"},
        {"pipeline": "simple", "microbatches": 4, "active_microbatches": 2, "memory_weight": 0.5},
        {"auto_partition": False, "default_partition": 0, **INTERNAL},
    ],
)
def test_to_dict_round_trip(params: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = resolve(params)
    data = cfg.to_dict()
    assert set(data) == SMP_KEYS
    assert resolve(data) == cfg
    assert SMPConfig(**data) == cfg
    assert resolve(json.loads(json.dumps(data))) == cfg


FROZEN_KEYS = """
pipeline_parallel_degree tensor_parallel_degree microbatches pipeline optimize placement_strategy auto_partition
default_partition memory_weight active_microbatches deterministic_server ddp ddp_port ddp_dist_backend horovod
contiguous offload_activations activation_loading_horizon shard_optimizer_state prescaled_batch skip_tracing
fp16_params fp16 bf16 delayed_parameter_initialization sharded_data_parallel_degree sdp_reduce_bucket_size
sdp_param_persistence_threshold sdp_max_live_parameters sdp_hierarchical_allgather sdp_gradient_clipping
tensor_parallel_seed static_mode fast_mode checkpoint_attentions _fp32_grad_accumulation _match_weights
_shard_offloaded_activations task_level_activation_loading_horizon herring load_partition partition_file
_sharded_data_parallelism_config
""".split()


def test_smp_keys_frozen() -> None:
    """The accepted key set is part of the public surface: change it on purpose only."""
    assert SMP_KEYS == frozenset(FROZEN_KEYS) and len(FROZEN_KEYS) == 43
    assert list(resolve().to_dict()) == FROZEN_KEYS  # declaration order, for readable logs


def test_tensor_parallelism_with_pipeline_parallelism_is_accepted() -> None:
    assert "tensor_parallel_degree" not in UNSUPPORTED
    assert resolve({"tensor_parallel_degree": 2, "ddp": True}).tensor_parallel_degree == 2
    cfg = resolve({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "ddp": True})
    assert (cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree) == (2, 2)
