"""The ``quick`` tier (``python -m pytest -m quick``): a cheap subset for use while developing, under 2 minutes.

It touches every package folder of smp_compat with at least one test that runs its code (a multi-process
fidelity check for data, pipeline, tensor and sharded data parallelism, 16 bits, a selftest battery, the
shim, the launcher's plan), and leaves out the slow ends: the example scripts launched end to end, the
flagship matrix, the fault and kill tests. It is no substitute for the whole suite, which CI runs.

Entries are test files or node-id prefixes relative to tests/; the conftest hook marks what they match, and
tests/core/test_quick_tier.py keeps each entry pointing at a test that exists.
"""

from __future__ import annotations

QUICK: tuple[str, ...] = (
    # checkpoints/
    "checkpoints/test_serialization.py", "checkpoints/test_signing.py", "checkpoints/test_load_policy.py",
    "checkpoints/test_convert.py", "checkpoints/test_checkpoint_folders.py", "checkpoints/test_tp_reshard.py",
    "checkpoints/test_state_dicts.py",
    # cli/ (and selftest/: a short battery on forked ranks with an injected fault)
    "cli/test_check.py", "cli/test_check_members.py", "cli/test_estimator.py", "cli/test_plan.py",
    "cli/test_sm_env.py", "cli/test_support.py", "cli/test_versions.py", "cli/test_bind_cores.py",
    "cli/test_timeline.py", "cli/test_selftest.py::test_unknown_check_is_refused_before_launching",
    "cli/test_selftest.py::test_one_rank_failing_alone_does_not_hang_the_others",
    # shim/: `import smdistributed.modelparallel.torch` through PYTHONPATH
    "cli/test_launch_e2e.py::test_shim_is_absent_by_default_and_boots_from_pythonpath",
    # config/, the top-level modules (topology, ranks, comm, model, launch) and the import layering
    "core/test_config.py", "core/test_launch.py", "core/test_comm.py", "core/test_model_api.py",
    "core/test_layout.py", "core/test_topology.py::test_worked_example", "core/test_topology.py::test_dtp",
    "core/test_dp_fidelity.py::test_dp2_microbatches4",
    "core/test_quick_tier.py", "core/test_sweep_row.py",
    # examples/: the benchmarks' partition-balance planner (the examples themselves run end to end: whole suite)
    "examples/test_partition_balance_smoke.py::test_best_split_is_the_brute_force_optimum",
    # memory/
    "memory/test_delayed_init.py", "memory/test_checkpoint_buffers.py", "memory/test_sharding_amp.py",
    "memory/test_activation_checkpointing.py::test_set_activation_checkpointing_needs_the_model_first",
    # nn/ (the Hugging Face swaps included)
    "nn/test_tp_kernels.py", "nn/test_tp_hf_activations.py", "nn/test_hf_unsupported_inputs.py",
    "nn/test_tp_gptj.py", "nn/test_tp_fidelity.py::test_tp2_matches_single_process",
    # partitioning/
    "partitioning/test_partition_manual.py", "partitioning/test_partition_auto.py", "partitioning/test_trace.py",
    # precision/ and amp/ (patches/ is imported by smp_compat itself and walked by core/test_layout.py)
    "precision/test_fp16.py::test_bf16_master_weights_and_clipping_match_plain_pytorch",
    "precision/test_amp.py::test_overflow_on_one_stage_skips_the_step_on_every_stage",
    # runtime/
    "runtime/test_lockstep.py", "runtime/test_local_links.py", "runtime/test_failure_report.py",
    "runtime/test_pp_thread_state.py", "runtime/test_pp_fidelity.py::test_pp2_manual_matches_single_process",
    # sdp/
    "sdp/test_sdp_wrap.py", "sdp/test_sdp_features.py::test_sdp_must_divide_the_data_parallel_degree",
    "sdp/test_sdp_fidelity.py::test_sdp_matches_plain_pytorch[sdp2-default-clip]",
    # stepping/
    "stepping/test_split.py", "stepping/test_step_noise.py", "stepping/test_step_output.py",
    # trainer/ (Hugging Face's Trainer on SMP v1)
    "trainer/test_trainer_fixes.py::test_step_output_detach_gives_detached_values_that_concat",
    "trainer/test_trainer_fixes.py::test_module_manager_translates_a_swapped_model_to_hugging_face_names",
    # v2/ (torch.sagemaker): config, layout, finder, check, the FSDP façade at hybrid shard 2, transform at tp 2,
    # context-parallel attention, MoE routing, the checkpoint API's small pieces
    "v2/test_v2_config.py", "v2/test_v2_layout.py", "v2/test_v2_check.py", "v2/test_transform_api.py",
    "v2/test_v2_checkpoint_api.py", "v2/test_moe_routing.py", "v2/test_context_parallel.py::test_positions",
    "v2/test_context_parallel.py::test_attention_and_loss_equal_the_unsplit_computation_at_cp3",
    "v2/test_fsdp_fidelity.py::test_layout_matches_one_process[hsd2-world2",
    "v2/test_transform_tp.py::test_tp2_equals_one_process[llama]",
)  # fmt: skip


def is_quick(nodeid: str) -> bool:
    """Whether a test's node id (``tests/...``) falls under an entry of ``QUICK`` (a file, or a node-id prefix)."""
    relative = nodeid.removeprefix("tests/")
    return any(relative.startswith(entry if "::" in entry else entry + "::") for entry in QUICK)
