"""The cross-key rules of SMP v1's config (SMP_REFERENCE §1.3) and the world-size rule, as messages."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from smp_compat.config.schema import SMPConfig

__all__ = ["rule_problems", "world_size_problem"]


def rule_problems(cfg: SMPConfig) -> list[str]:
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
    """Sharded data parallelism excludes pipeline parallelism and optimizer-state sharding (SMP 1.11-1.15)."""
    sdp = cfg.sharded_data_parallel_degree
    if sdp == 1:
        return []
    clashes = [
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


def world_size_problem(cfg: SMPConfig, world: int) -> str | None:
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
    sdp, dp = cfg.sharded_data_parallel_degree, world // (pp * tp)
    if sdp > 1 and dp % sdp:
        group = "data-parallel" if tp == 1 else "reduced-data-parallel"  # with tp, sdp shards over rdp (SMP 1.15)
        return (
            f"sharded_data_parallel_degree ({sdp}) must divide the {group} degree ({dp} = world size {world} "
            f"/ {degrees}); choose a divisor of {dp}, as SMP requires."
        )
    if world > pp * tp and not cfg.ddp:
        return (
            f"The world size ({world}) is larger than {degrees} = {pp * tp}, so the job holds "
            f'{world // (pp * tp)} model replicas, which needs data parallelism; set "ddp": True, as SMP requires.'
        )
    return None
