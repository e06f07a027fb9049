"""The SageMaker-job options shared by ``smp-compat run`` and ``smp-compat env``, and the job they define."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from smp_compat.cli.estimator import Estimator
from smp_compat.cli.hyperparameters import read_hyperparameters
from smp_compat.cli.sm_env import (
    DEFAULT_JOB_DIR, JOB_DIR_ENV, SAGEMAKER_ROOT, TrainingJob, channel_env_name, parse_channel,
)  # fmt: skip
from smp_compat.errors import SMPConfigError

__all__ = ["JOB_VALUED", "add_job_options", "build_job"]

JOB_VALUED = ("--job-dir", "--channel", "--hyperparameters", "--model-dir", "--output-dir", "--checkpoint-dir")
"""Options that take a value (removed before torchrun sees the rest)."""


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """SageMaker's training environment: folders, channels, hyperparameters."""
    group = parser.add_argument_group(
        "SageMaker training environment (SM_* variables; an exported SM_* variable is kept unless an option sets it)"
    )
    group.add_argument(
        "--job-dir", metavar="DIR", help=f"the job folder: model/, output/data/, checkpoints/, input/config/ (default "
        f"${JOB_DIR_ENV}, else ./{DEFAULT_JOB_DIR})"
    )  # fmt: skip
    group.add_argument(
        "--channel", action="append", default=[], metavar="NAME=DIR",
        help="an input channel: SM_CHANNEL_<NAME>=DIR, listed in SM_CHANNELS (repeatable)",
    )  # fmt: skip
    group.add_argument(
        "--hyperparameters", metavar="JSON_OR_FILE",
        help="the job's hyperparameters (JSON object, inline or a file): given to the script as --name value "
        "arguments exactly as SageMaker does, and as SM_HPS / SM_HP_<NAME>",
    )  # fmt: skip
    group.add_argument("--model-dir", metavar="DIR", help="SM_MODEL_DIR (default JOB_DIR/model)")
    group.add_argument(
        "--output-dir", metavar="DIR", help="SM_OUTPUT_DIR; SM_OUTPUT_DATA_DIR is DIR/data (default JOB_DIR/output)"
    )
    group.add_argument(
        "--checkpoint-dir", metavar="DIR",
        help=f"the local {SAGEMAKER_ROOT}/checkpoints: hyperparameters naming that path get DIR instead "
        "(default JOB_DIR/checkpoints)",
    )  # fmt: skip


def _path(value: str) -> Path:
    return Path(value).expanduser().resolve()


def _checkpoint_dir(ns: argparse.Namespace, estimator: Estimator | None, job_dir: Path) -> Path:
    """--checkpoint-dir, else the estimator's checkpoint_local_path (unless it is SageMaker's own), else the default."""
    if ns.checkpoint_dir:
        return _path(ns.checkpoint_dir)
    local = estimator.checkpoint_local_path if estimator is not None else None
    if local and not local.startswith(SAGEMAKER_ROOT + "/"):
        return _path(local)
    return job_dir / "checkpoints"


def _hyperparameters(ns: argparse.Namespace, estimator: Estimator | None) -> dict[str, Any]:
    """The estimator's, with --hyperparameters on top."""
    hps = dict(estimator.hyperparameters) if estimator is not None else {}
    if ns.hyperparameters is not None:
        hps.update(read_hyperparameters(ns.hyperparameters))
    return hps


def _explicit(ns: argparse.Namespace, channels: Mapping[str, Path]) -> frozenset[str]:
    """The variables an option set, which win over exported values."""
    names = [channel_env_name(name) for name in channels]
    if ns.model_dir:
        names.append("SM_MODEL_DIR")
    if ns.output_dir:
        names += ["SM_OUTPUT_DIR", "SM_OUTPUT_DATA_DIR", "SM_OUTPUT_INTERMEDIATE_DIR"]
    if ns.hyperparameters is not None:
        names += ["SM_HPS", "SM_USER_ARGS"]
    if channels:
        names += ["SM_CHANNELS", "SM_INPUT_DATA_CONFIG"]
    return frozenset(names)


def _channels(values: list[str]) -> dict[str, Path]:
    channels: dict[str, Path] = {}
    for value in values:
        name, path = parse_channel(value)
        if name in channels:
            raise SMPConfigError(f"--channel {name!r} is given twice; give each channel once.")
        channels[name] = path
    return channels


def build_job(
    ns: argparse.Namespace,
    environ: Mapping[str, str],
    *,
    nnodes: int,
    node_rank: int,
    num_gpus: int,
    entry_point: Path | None,
    estimator: Estimator | None = None,
) -> TrainingJob:
    """The job the options (and the estimator, if any) describe; every input checked, nothing written."""
    job_dir = _path(ns.job_dir or environ.get(JOB_DIR_ENV, "").strip() or DEFAULT_JOB_DIR)
    given = _channels(ns.channel)
    channels = estimator.channel_dirs(given) if estimator is not None else given
    return TrainingJob(
        job_dir=job_dir,
        model_dir=_path(ns.model_dir) if ns.model_dir else job_dir / "model",
        output_dir=_path(ns.output_dir) if ns.output_dir else job_dir / "output",
        checkpoint_dir=_checkpoint_dir(ns, estimator, job_dir),
        channels=channels,
        hyperparameters=_hyperparameters(ns, estimator),
        entry_point=entry_point,
        source_dir=estimator.source_dir if estimator is not None else None,
        nnodes=nnodes,
        node_rank=node_rank,
        num_gpus=num_gpus,
        instance_type=estimator.instance_type if estimator is not None else None,
        job_name=(estimator.job_name if estimator is not None and estimator.job_name else "smp-compat-job"),
        log_level=estimator.log_level if estimator is not None and estimator.log_level is not None else 20,
        explicit=_explicit(ns, given),
    )
