"""The SageMaker-job side of ``smp-compat run``: processes and nodes, the local job, its variables, its report.

A SageMaker job decides how many processes each node runs (the distribution's ``mpi.processes_per_host``, or
one per GPU of the estimator's ``instance_type``) and how many nodes (``instance_count``); here those become
torchrun's ``--nproc-per-node`` and ``--nnodes`` unless the user gave them. The job's folders, channels and
hyperparameters become the ``SM_*`` variables (``sm_env.py``) and the script's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from smp_compat.cli.estimator import Estimator, ignored_warning
from smp_compat.cli.hyperparameters import split_framework
from smp_compat.cli.job_options import build_job
from smp_compat.cli.launch_config import LaunchConfig
from smp_compat.cli.run_args import NNODES_OPTIONS, NODE_RANK_OPTIONS, NPROC_OPTIONS, given, node_count, option_value
from smp_compat.cli.sm_env import FRAMEWORK_ENV, TrainingJob, node_position, rewrite_paths, training_environment

__all__ = [
    "job_environment",
    "local_job",
    "num_gpus",
    "print_job",
    "process_counts",
    "rewrite_notes",
    "working_directory",
]


def process_counts(
    options: list[str], estimator: Estimator | None, launch: LaunchConfig, env: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """(torchrun options with the job's --nnodes and --nproc-per-node where the user gave none, notes).

    The notes start with the estimator's arguments that mean nothing here, if any.
    """
    warning = ignored_warning(estimator) if estimator is not None else None
    notes = [warning] if warning else []
    nproc_given = given(options, NPROC_OPTIONS, "PET_NPROC_PER_NODE", env)
    count = launch.processes_per_host
    if count is None and estimator is not None:
        count = estimator.processes_per_host()
        if count is None and not nproc_given:
            notes.append(
                f"instance_type {estimator.instance_type!r} is not in smp-compat's table of GPU instances and the "
                "distribution sets no mpi.processes_per_host: pass --nproc-per-node (torchrun's default is 1)"
            )
    if count is not None and not nproc_given:
        options = ["--nproc-per-node", str(count), *options]
    if estimator is not None and not given(options, NNODES_OPTIONS, "PET_NNODES", env):
        options = ["--nnodes", str(estimator.instance_count), *options]
    return options, notes


def num_gpus() -> int:
    """GPUs on this host (SM_NUM_GPUS)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_job(
    ns: argparse.Namespace, options: Sequence[str], estimator: Estimator | None, env: Mapping[str, str]
) -> TrainingJob:
    """The SageMaker job: its hosts follow the launcher's node count and node rank."""
    nnodes = node_rank = None
    if given(options, NNODES_OPTIONS, "PET_NNODES", env):
        nnodes = node_count(option_value(options, NNODES_OPTIONS, env.get("PET_NNODES") or ns.nnodes))
    if given(options, NODE_RANK_OPTIONS, "PET_NODE_RANK", env):
        rank = option_value(options, NODE_RANK_OPTIONS, env.get("PET_NODE_RANK") or str(ns.node_rank))
        node_rank = int(rank) if rank.isdigit() else None
    count, index = node_position(env, nnodes, node_rank)
    entry = None if ns.module or ns.no_python else Path(ns.training_script).resolve()
    return build_job(ns, env, nnodes=count, node_rank=index, num_gpus=num_gpus(), entry_point=entry, estimator=estimator)


def working_directory(job: TrainingJob, estimator: Estimator | None) -> str | None:
    """An estimator's job runs in its source_dir (else the entry point's folder), as on SageMaker."""
    if estimator is None or job.entry_point is None:
        return None
    return str(job.source_dir or job.entry_point.parent)


def job_environment(
    job: TrainingJob, estimator: Estimator | None, env: Mapping[str, str], base: dict[str, str]
) -> None:
    """Add the SM_* variables, the sagemaker_* framework hyperparameters and the estimator's environment."""
    base.update(training_environment(job, env))
    framework = split_framework(job.hyperparameters)[1]
    if framework:
        base[FRAMEWORK_ENV] = json.dumps({**json.loads(base[FRAMEWORK_ENV]), **framework})
    if estimator is None:
        return
    if estimator.dependencies:
        base["PYTHONPATH"] = os.pathsep.join([*(str(d) for d in estimator.dependencies), base["PYTHONPATH"]])
    for name, value in estimator.environment.items():
        if name not in env:
            base[name] = value


def rewrite_notes(job: TrainingJob) -> list[str]:
    """One note per hyperparameter whose SageMaker path was replaced by the local one."""
    notes = []
    for key, value in sorted(job.script_hyperparameters.items()):
        local = rewrite_paths(job, value)
        if local != value:
            notes.append(f"hyperparameter {key}: {value} -> {local}")
    return notes


def print_job(job: TrainingJob, env: Mapping[str, str], cwd: str | None) -> None:
    """The SageMaker side: folders, channels, hosts, and the hyperparameters as the script will see them."""
    print(f"SageMaker job {job.job_name!r} in {job.job_dir} (created at launch):")
    print(f"  model {job.model_dir}, output {job.output_dir}")
    print(f"  checkpoints (for /opt/ml/checkpoints) {job.checkpoint_dir}")
    for name, path in sorted(job.channels.items()):
        print(f"  channel {name}: {path}")
    print(f"  host {job.hosts[job.node_rank]} of {json.dumps(job.hosts)} (node rank {job.node_rank})")
    print(f"  script arguments from hyperparameters: {shlex.join(job.script_args()) or '(none)'}")
    kept = sorted(k for k in ("SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR", "SM_CURRENT_HOST", "SM_HOSTS") if k not in env)
    if kept:
        print(f"  kept as exported: {', '.join(kept)}")
    if cwd is not None:
        print(f"  working directory: {cwd} (the entry point's source_dir, as on SageMaker)")
