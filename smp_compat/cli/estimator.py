"""``smp-compat run --estimator job.json``: a ``sagemaker.pytorch.PyTorch`` estimator's arguments, run here.

The JSON object holds the estimator's keyword arguments (``entry_point``, ``source_dir``,
``hyperparameters``, ``distribution``, ``instance_count``, ``instance_type``, ``environment``, ...) and
optionally ``inputs``, what would be passed to ``estimator.fit(inputs)``: channel name to a local
directory (``file://`` or a plain path) or an S3 URI, which then needs ``--channel NAME=DIR``.
Relative paths are relative to the JSON file's folder. Arguments that only mean something on
SageMaker (``role``, ``output_path``, S3 URIs, ...) are listed in one warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smp_compat.cli.hyperparameters import check_hyperparameters
from smp_compat.cli.sm_env import check_channel_name
from smp_compat.errors import SMPConfigError

__all__ = ["GPUS_PER_INSTANCE", "Estimator", "read_estimator"]

GPUS_PER_INSTANCE: dict[str, int] = {
    "ml.p3.2xlarge": 1, "ml.p3.8xlarge": 4, "ml.p3.16xlarge": 8, "ml.p3dn.24xlarge": 8,
    "ml.p4d.24xlarge": 8, "ml.p4de.24xlarge": 8,
    "ml.p5.48xlarge": 8, "ml.p5e.48xlarge": 8, "ml.p5en.48xlarge": 8,
    "ml.g4dn.xlarge": 1, "ml.g4dn.2xlarge": 1, "ml.g4dn.4xlarge": 1, "ml.g4dn.8xlarge": 1,
    "ml.g4dn.16xlarge": 1, "ml.g4dn.12xlarge": 4,
    "ml.g5.xlarge": 1, "ml.g5.2xlarge": 1, "ml.g5.4xlarge": 1, "ml.g5.8xlarge": 1, "ml.g5.16xlarge": 1,
    "ml.g5.12xlarge": 4, "ml.g5.24xlarge": 4, "ml.g5.48xlarge": 8,
    "ml.g6.xlarge": 1, "ml.g6.2xlarge": 1, "ml.g6.4xlarge": 1, "ml.g6.8xlarge": 1, "ml.g6.16xlarge": 1,
    "ml.g6.12xlarge": 4, "ml.g6.24xlarge": 4, "ml.g6.48xlarge": 8,
}  # fmt: skip
"""GPUs per SageMaker training instance type: the default processes per host (one per GPU)."""

_USED = frozenset({
    "entry_point", "source_dir", "hyperparameters", "distribution", "instance_count", "instance_type",
    "checkpoint_local_path", "environment", "inputs", "dependencies", "container_log_level", "base_job_name",
})  # fmt: skip
_SAGEMAKER_ONLY = frozenset({
    "role", "output_path", "output_kms_key", "code_location", "checkpoint_s3_uri", "sagemaker_session",
    "framework_version", "py_version", "image_uri", "volume_size", "volume_kms_key", "max_run", "max_wait",
    "use_spot_instances", "max_retry_attempts", "subnets", "security_group_ids", "tags", "model_uri",
    "model_channel_name", "metric_definitions", "enable_sagemaker_metrics", "encrypt_inter_container_traffic",
    "enable_network_isolation", "debugger_hook_config", "tensorboard_output_config", "rules",
    "profiler_config", "disable_profiler", "input_mode", "keep_alive_period_in_seconds", "git_config",
    "instance_groups", "training_repository_access_mode", "training_repository_credentials_provider_arn",
    "container_entry_point", "container_arguments", "disable_output_compression", "enable_infra_check",
    "enable_remote_debug", "environment_variables", "job_name", "compiler_config", "training_plan",
})  # fmt: skip


@dataclass(frozen=True)
class Estimator:
    """The parts of an estimator that define a local job; paths absolute."""

    source: str
    entry_point: Path
    source_dir: Path | None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    distribution: dict[str, Any] | None = None
    instance_count: int = 1
    instance_type: str | None = None
    checkpoint_local_path: str | None = None
    environment: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)
    dependencies: tuple[Path, ...] = ()
    log_level: int | None = None
    job_name: str | None = None
    ignored: tuple[str, ...] = ()

    def processes_per_host(self) -> int | None:
        """One per GPU of ``instance_type`` (None when the type is not in the table)."""
        return GPUS_PER_INSTANCE.get(self.instance_type or "")

    def channel_dirs(self, given: Mapping[str, Path]) -> dict[str, Path]:
        """``inputs`` as local folders; ``--channel`` wins; an S3 input without one is an error."""
        channels: dict[str, Path] = {}
        for name, uri in self.inputs.items():
            if name in given:
                continue
            if uri.startswith("s3://"):
                raise SMPConfigError(
                    f"Channel {name!r} of {self.source} reads {uri}, an S3 location; smp-compat reads local files "
                    f"only. Copy the data to a local folder and pass --channel {name}=DIR."
                )
            path = _resolve(self.source, uri.removeprefix("file://"))
            if not path.is_dir():
                raise SMPConfigError(
                    f"Channel {name!r} of {self.source} names {str(path)!r}, which is not a directory. Fix "
                    f"'inputs' or pass --channel {name}=DIR."
                )
            channels[name] = path
        return {**channels, **given}


def _resolve(source: str, path: str) -> Path:
    """Relative paths in the estimator file are relative to its folder."""
    return (Path(source).parent / Path(path).expanduser()).resolve()


def read_estimator(path: str) -> Estimator:
    """Read and check ``--estimator FILE``, naming what to fix."""
    file = Path(path)
    if not file.is_file():
        raise SMPConfigError(f"--estimator {path!r} is not a file. Pass a JSON file of PyTorch estimator arguments.")
    text = file.read_text(encoding="utf-8")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SMPConfigError(
            f"--estimator file {path!r} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}). "
            "Write the estimator's keyword arguments as one JSON object."
        ) from None
    if not isinstance(raw, dict):
        raise SMPConfigError(f"--estimator file {path!r} must hold one JSON object, got {type(raw).__name__}.")
    return _estimator(path, raw)


def _estimator(source: str, raw: dict[str, Any]) -> Estimator:
    where = f"--estimator file {source!r}"
    entry = raw.get("entry_point")
    if not isinstance(entry, str) or not entry.strip():
        raise SMPConfigError(f"{where} has no \"entry_point\": name the training script, e.g. \"train.py\".")
    source_dir = _source_dir(where, source, raw.get("source_dir"))
    entry_point = (source_dir / entry) if source_dir is not None else _resolve(source, entry)
    if not entry_point.is_file():
        under = f"under source_dir {str(source_dir)!r}" if source_dir is not None else "beside the estimator file"
        raise SMPConfigError(f"{where}: entry_point {entry!r} not found {under} (looked for {str(entry_point)!r}).")
    return Estimator(
        source=source,
        entry_point=entry_point.resolve(),
        source_dir=source_dir,
        hyperparameters=check_hyperparameters(raw.get("hyperparameters") or {}, f'{where} "hyperparameters"'),
        distribution=_dict(where, raw, "distribution"),
        instance_count=_count(where, raw.get("instance_count", 1)),
        instance_type=_str(where, raw, "instance_type"),
        checkpoint_local_path=_str(where, raw, "checkpoint_local_path"),
        environment={str(k): str(v) for k, v in (_dict(where, raw, "environment") or {}).items()},
        inputs=_inputs(where, raw.get("inputs")),
        dependencies=tuple(_resolve(source, d) for d in _list(where, raw, "dependencies")),
        log_level=_level(where, raw.get("container_log_level")),
        job_name=_str(where, raw, "base_job_name"),
        ignored=tuple(sorted(k for k in raw if k not in _USED)),
    )


def _source_dir(where: str, source: str, value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.startswith("s3://") or not _resolve(source, value).is_dir():
        raise SMPConfigError(
            f"{where}: source_dir {value!r} is not a local directory (an S3 tarball cannot be used here). "
            "Point it at the folder that holds the entry point."
        )
    return _resolve(source, value)


def _dict(where: str, raw: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise SMPConfigError(f'{where}: "{key}" must be a JSON object, got {value!r:.80}.')
    return value


def _str(where: str, raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise SMPConfigError(f'{where}: "{key}" must be a string, got {value!r:.80}.')
    return value


def _list(where: str, raw: Mapping[str, Any], key: str) -> list[str]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SMPConfigError(f'{where}: "{key}" must be a list of paths, got {value!r:.80}.')
    return value


def _count(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SMPConfigError(f'{where}: "instance_count" must be a positive integer, got {value!r}.')
    return value


def _level(where: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise SMPConfigError(f'{where}: "container_log_level" must be an integer (logging.INFO is 20), got {value!r}.')
    return value


def _inputs(where: str, value: Any) -> dict[str, str]:
    """``fit(inputs)``: a dict of channel to location, or one location (the ``training`` channel)."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = {"training": value}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SMPConfigError(f'{where}: "inputs" must map channel names to local paths or S3 URIs, got {value!r:.80}.')
    for name in value:
        check_channel_name(name, f'{where} "inputs"')
    return dict(value)


def ignored_warning(estimator: Estimator) -> str | None:
    """One line naming the arguments that do nothing here (known SageMaker-only ones, and unknown ones)."""
    if not estimator.ignored:
        return None
    known = [k for k in estimator.ignored if k in _SAGEMAKER_ONLY]
    unknown = [k for k in estimator.ignored if k not in _SAGEMAKER_ONLY]
    parts = []
    if known:
        parts.append(f"{', '.join(known)} (meaningful on SageMaker only)")
    if unknown:
        parts.append(f"{', '.join(unknown)} (not an estimator argument smp-compat knows)")
    return f"warning: {estimator.source} arguments ignored: {'; '.join(parts)}"
