"""The SageMaker-job side of ``smp-compat run``: ``--estimator`` on the command line, the job's variables, its report."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Mapping, Sequence

from smp_compat.cli.estimator import Estimator, read_estimator
from smp_compat.cli.hyperparameters import split_framework
from smp_compat.cli.sm_env import FRAMEWORK_ENV, TrainingJob, rewrite_paths, training_environment
from smp_compat.errors import SMPConfigError

__all__ = ["ESTIMATOR_FLAG", "job_environment", "parse_argv", "print_job", "rewrite_notes"]

ESTIMATOR_FLAG = "--estimator"
"""``smp-compat run --estimator FILE``: the job a ``sagemaker.pytorch.PyTorch`` estimator describes."""

_PLACEHOLDER = "<the estimator's entry_point>"


def parse_argv(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[str], Estimator | None]:
    """The options, the command line with the script in place, and the estimator (``--estimator``) if any.

    With ``--estimator`` the entry point is the script: the command line is parsed with a stand-in
    for it, and a script given as well is an error.
    """
    if any(t == ESTIMATOR_FLAG or t.startswith(ESTIMATOR_FLAG + "=") for t in argv):
        ns = parser.parse_args([*argv, _PLACEHOLDER])
        if ns.estimator is not None:
            if ns.training_script != _PLACEHOLDER or ns.training_script_args:
                raise SMPConfigError(
                    f"{ESTIMATOR_FLAG} names the training script (its entry_point), and a script was given too "
                    f"({ns.training_script!r}). Remove the script from the command line, or drop {ESTIMATOR_FLAG}."
                )
            estimator = read_estimator(ns.estimator)
            ns.training_script = str(estimator.entry_point)
            return ns, [*argv, ns.training_script], estimator
    return parser.parse_args(list(argv)), list(argv), None


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
