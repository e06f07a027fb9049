"""The registry cannot claim more than the code does: every entry marked supported is used end to end.

``USES`` maps each supported API, member and config key in smp_compat/cli/support.py to the exercise that
uses it and checks the outcome (training exercises match plain single-process PyTorch). The exercises
run in two 4-rank CPU worlds (pp = 2 x dp = 2 where they need both). Marking an entry supported without
adding an exercise here fails test_every_supported_entry_has_an_exercise.
"""

from __future__ import annotations

import inspect
import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

import exercises_api as api
import exercises_common
import exercises_training as tr
from smp_compat.cli.support import API, CONFIG, METHODS, Status
from smp_compat.testing import run_ranks

Exercise = Callable[..., None]


def _same(exercise: Exercise, names: str) -> dict[str, Exercise]:
    return dict.fromkeys(names.split(), exercise)


API_USES: dict[str, Exercise] = {
    **_same(api.init_reset_shutdown, "init is_initialized num_microbatches reset shutdown"),
    **_same(tr.pipeline_with_data_parallelism, "is_tracing state step DistributedModel DistributedOptimizer"),
    **_same(tr.step_output_members, "StepOutput"),
    **_same(tr.manual_partition_and_model_members, "partition set_partition"),
    **_same(tr.delayed_initialization, "delay_param_initialization"),
    **_same(tr.activation_checkpointing, "set_activation_checkpointing checkpoint checkpoint_sequential "
            "patches.checkpoint.checkpoint patches.checkpoint.checkpoint_sequential"),
    **_same(tr.amp_grad_scaler, "amp amp.GradScaler"),
    **_same(tr.sharded_data_parallelism, "register_parameter"),
    **_same(tr.tensor_parallelism, "model_creation nn nn.DistributedLinear nn.DistributedModule "
            "nn.DistributedTransformer nn.DistributedTransformerOutputLayer nn.FusedLayerNorm"),
    **_same(tr.tensor_parallelism_with_pipeline, "tp_register tp_register_with_module"),
    **_same(api.save_load_and_resume, "save load save_checkpoint resume_from_checkpoint"),
    **_same(api.ranks_groups_and_communication,
            "rank size local_rank local_size pp_rank pp_size tp_rank tp_size dp_rank dp_size rdp_rank rdp_size "
            "mp_rank mp_size get_mp_group get_dp_group get_pp_group get_tp_group get_rdp_group "
            "get_world_process_group get_dp_process_group get_mp_process_group get_pp_process_group "
            "get_tp_process_group get_rdp_process_group CommGroup RankType WORLD PP_GROUP TP_GROUP RDP_GROUP "
            "DP_GROUP MP_GROUP broadcast send recv_from allgather barrier dp_barrier mp_barrier pp_barrier "
            "tp_barrier rdp_barrier gather"),
    **_same(api.errors_are_raised_where_smp_raised_them,
            "SMPError SMPConfigError SMPUnsupportedError TensorSplitError FwdExecutionNotInStepFnError "
            "MultipleDistributedModelError DDPNotEnabledError"),
}  # fmt: skip

MEMBER_USES: dict[str, Exercise] = {
    **_same(tr.pipeline_with_data_parallelism, "DistributedModel.forward DistributedModel.backward "
            "DistributedOptimizer.step DistributedOptimizer.zero_grad"),
    **_same(tr.manual_partition_and_model_members,
            "DistributedModel.partitioned DistributedModel.local_parameters DistributedModel.local_named_parameters "
            "DistributedModel.local_buffers DistributedModel.local_named_buffers DistributedModel.local_modules "
            "DistributedModel.local_named_modules DistributedModel.get_module DistributedModel.is_local_parameter "
            "DistributedModel.is_local_buffer DistributedModel.get_param_name "
            "DistributedModel.register_post_partition_hook DistributedModel.register_post_step_hook "
            "DistributedModel.distributed_modules DistributedModel.is_distributed_parameter "
            "DistributedModel.is_distributed_buffer DistributedModel.is_scaled_batch_parameter "
            "DistributedModel.is_scaled_batch_buffer DistributedModel.default_reducer_named_parameters "
            "DistributedModel.scaled_batch_reducer_named_parameters"),
    **_same(api.save_load_and_resume,
            "DistributedModel.state_dict DistributedModel.local_state_dict DistributedModel.load_state_dict "
            "DistributedOptimizer.state_dict DistributedOptimizer.local_state_dict "
            "DistributedOptimizer.local_optimizer_state_dict DistributedOptimizer.load_state_dict "
            "DistributedOptimizer.load_local_optimizer_state_dict"),
    **_same(tr.step_output_members, "StepOutput.outputs StepOutput.reduce_mean StepOutput.reduce_sum "
            "StepOutput.concat StepOutput.stack StepOutput.map StepOutput.detach StepOutput.clear"),
}  # fmt: skip

CONFIG_USES: dict[str, Exercise] = {
    **_same(tr.pipeline_with_data_parallelism, "pipeline_parallel_degree microbatches ddp auto_partition "
            "memory_weight"),
    **_same(tr.schedule_and_placement_keys, "partitions pipeline placement_strategy active_microbatches "
            "deterministic_server"),
    **_same(tr.manual_partition_and_model_members, "default_partition"),
    **_same(api.launcher_keys, "ddp_port ddp_dist_backend"),
    **_same(tr.activation_checkpointing, "offload_activations"),
    **_same(tr.sharded_optimizer_state, "shard_optimizer_state"),
    **_same(tr.sixteen_bit, "fp16 bf16"),
    **_same(tr.delayed_initialization, "delayed_parameter_initialization"),
    **_same(tr.sharded_data_parallelism, "sharded_data_parallel_degree sdp_gradient_clipping"),
    **_same(tr.tensor_parallelism, "tensor_parallel_degree prescaled_batch optimize tensor_parallel_seed"),
}  # fmt: skip

TABLES = [("API", API, API_USES), ("member", METHODS, MEMBER_USES), ("config key", CONFIG, CONFIG_USES)]
WORLDS: dict[str, list[Exercise]] = {"training": tr.TRAINING, "api": [*api.API, api.LAST]}


def test_every_supported_entry_has_an_exercise() -> None:
    for label, registry, uses in TABLES:
        supported = {name for name, entry in registry.items() if entry.status is Status.SUPPORTED}
        missing = sorted(supported - set(uses))
        assert not missing, (
            f"smp_compat/cli/support.py marks these {label}s supported, but no exercise in tests/cli/test_support_e2e.py "
            f"uses them: {missing}. Add one (or mark them partial with a note)."
        )
        assert not set(uses) - set(registry), f"not {label}s of the registry: {sorted(set(uses) - set(registry))}"
        downgraded = sorted(name for name in uses if name not in supported)
        assert not downgraded, f"{label}s no longer marked supported still listed: {downgraded}"


def test_each_exercise_names_what_it_is_listed_for() -> None:
    """A guard against a table that lies: the exercise (or the shared helpers) spells each name it covers."""
    shared = inspect.getsource(exercises_common)
    for _, _, uses in TABLES:
        for name, exercise in uses.items():
            text = _source(exercise) + shared
            word = name.split(".")[-1]
            assert re.search(rf"\b{re.escape(word)}\b", text), f"{exercise.__name__} never mentions {name}"
    scheduled = {e for world in WORLDS.values() for e in world}
    listed = {e for _, _, uses in TABLES for e in uses.values()}
    assert listed <= scheduled, f"exercises in no world: {sorted(e.__name__ for e in listed - scheduled)}"


def _source(exercise: Exercise) -> str:
    """The exercise's code and that of the helpers of its own module it calls (``_Checkpointed``)."""
    module = inspect.getmodule(exercise)
    helpers = [exercise.__globals__[n] for n in exercise.__code__.co_names if n in exercise.__globals__]
    own = [h for h in helpers if inspect.getmodule(h) is module and (inspect.isclass(h) or inspect.isfunction(h))]
    return "".join(inspect.getsource(h) for h in [exercise, *own])


def _world(exercises: list[Exercise], tmp: str) -> list[str]:
    """Run the exercises in order on this rank, each from a fresh smp state."""
    import smp_compat as smp

    done = []
    for exercise in exercises:
        takes_tmp = len(inspect.signature(exercise).parameters) == 2
        try:
            exercise(smp, tmp) if takes_tmp else exercise(smp)
        finally:
            smp.reset()
        done.append(exercise.__name__)
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_supported_entries_work_end_to_end(world: str, tmp_path: Path) -> None:
    (tmp_path / "port").write_text(str(_free_port()))
    exercises = WORLDS[world]
    results = run_ranks(_world, 4, exercises, str(tmp_path), timeout=240)
    assert results == [[e.__name__ for e in exercises]] * 4
