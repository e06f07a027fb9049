"""SMP v2 config: the nine keys, defaults, types, cross-key and world rules, sources and their precedence."""

from __future__ import annotations

import json

import pytest

from smp_compat.errors import SMPConfigError
from smp_compat.v2.config import SMPv2Config, resolve_v2_config

NO_ENV: dict[str, str] = {}


def test_defaults_are_smp_v2_reference_values() -> None:
    cfg = resolve_v2_config(None, NO_ENV)
    assert cfg.model_dump() == {
        "hybrid_shard_degree": 0, "sm_activation_offloading": True, "activation_loading_horizon": 2,
        "fsdp_cache_flush_warnings": True, "allow_empty_shards": False, "tensor_parallel_degree": 1,
        "context_parallel_degree": 1, "expert_parallel_degree": 1, "random_seed": 12345,
    }  # fmt: skip


def test_environment_wins_over_init_argument_which_wins_over_state_writes() -> None:
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"hybrid_shard_degree": 4})}
    cfg = resolve_v2_config(
        {"hybrid_shard_degree": 2, "tensor_parallel_degree": 2},
        env,
        written={"tensor_parallel_degree": 1, "context_parallel_degree": 1, "random_seed": 3},
    )
    assert (cfg.hybrid_shard_degree, cfg.tensor_parallel_degree, cfg.random_seed) == (4, 2, 3)


def test_distribution_dict_and_json_file_sources(tmp_path) -> None:
    distribution = {
        "torch_distributed": {"enabled": True},
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"tensor_parallel_degree": 2}}},
    }
    assert resolve_v2_config(distribution, NO_ENV).tensor_parallel_degree == 2
    path = tmp_path / "smp_config.json"
    path.write_text(json.dumps({"hybrid_shard_degree": 2}))
    assert resolve_v2_config(str(path), NO_ENV).hybrid_shard_degree == 2
    env = {"SM_HP_MP_PARAMETERS": json.dumps(distribution["smdistributed"])}
    assert resolve_v2_config(None, env).tensor_parallel_degree == 2


def test_v1_keys_the_sdk_sends_are_accepted_quietly() -> None:
    cfg = resolve_v2_config({"placement_strategy": "cluster", "ddp": True, "hybrid_shard_degree": 2}, NO_ENV)
    assert cfg.hybrid_shard_degree == 2


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"hybrid_shard_degre": 2}, 'unknown key \'hybrid_shard_degre\' (value 2); did you mean "hybrid_shard_degree"?'),
        ({"tensor_paralel_degree": 2}, 'did you mean "tensor_parallel_degree"?'),
        ({"pipeline_parallel_degree": 2}, '"pipeline_parallel_degree" is an SMP v1 key'),
        ({"tensor_parallel_degree": "2"}, "tensor_parallel_degree: expected an int, got '2' (str)"),
        ({"sm_activation_offloading": 1}, "sm_activation_offloading: expected a bool"),
        ({"hybrid_shard_degree": -1}, "hybrid_shard_degree: must be >= 0, got -1"),
        ({"activation_loading_horizon": 0}, "activation_loading_horizon: must be >= 1"),
        ({"context_parallel_degree": 4, "hybrid_shard_degree": 2}, "context_parallel_degree (4) cannot exceed"),
        ({"context_parallel_degree": 2, "hybrid_shard_degree": 3}, "must be a multiple of context_parallel_degree"),
        ({"expert_parallel_degree": 2, "tensor_parallel_degree": 2}, "cannot be combined with tensor_parallel"),
    ],
)
def test_each_mistake_is_one_readable_error(params: dict, expected: str) -> None:
    with pytest.raises(SMPConfigError) as info:
        resolve_v2_config(params, NO_ENV)
    assert expected in str(info.value)


def test_error_from_the_environment_says_so() -> None:
    env = {"SM_HP_MP_PARAMETERS": json.dumps({"tensor_parallel_degree": 0})}
    with pytest.raises(SMPConfigError, match="Keys taken from SM_HP_MP_PARAMETERS"):
        resolve_v2_config(None, env)


@pytest.mark.parametrize(
    ("params", "world", "expected"),
    [
        ({"tensor_parallel_degree": 3}, 4, "= 3 must divide the number of processes (4)"),
        ({"hybrid_shard_degree": 4, "tensor_parallel_degree": 2}, 4, "cannot exceed world size / "),
        ({"hybrid_shard_degree": 3}, 4, "must divide world size / tensor_parallel_degree = 4"),
        ({"expert_parallel_degree": 3}, 4, "must divide the data-parallel size (4)"),
    ],
)
def test_world_rules(params: dict, world: int, expected: str) -> None:
    with pytest.raises(SMPConfigError) as info:
        SMPv2Config(**params).check_world_size(world)
    assert expected in str(info.value)


def test_valid_layouts_pass_the_world_rules() -> None:
    for params, world in [({"hybrid_shard_degree": 2, "tensor_parallel_degree": 2}, 8), ({}, 3),
                          ({"hybrid_shard_degree": 1}, 4), ({"hybrid_shard_degree": 2, "context_parallel_degree": 2}, 4)]:  # fmt: skip
        SMPv2Config(**params).check_world_size(world)


def test_context_and_expert_parallelism_are_accepted() -> None:
    SMPv2Config(context_parallel_degree=2, hybrid_shard_degree=2)
    SMPv2Config(expert_parallel_degree=2, hybrid_shard_degree=2)
