"""The rest of a SageMaker training job, on-prem: the ``SM_*`` variables, its folders, its hosts.

A SageMaker training container gives the script the variables of SageMaker's open-source training
toolkit (``sagemaker_training.environment.Environment.to_env_vars``): where to write the model
(``SM_MODEL_DIR``) and other output (``SM_OUTPUT_DATA_DIR``), where each input channel is
(``SM_CHANNEL_<NAME>``), the hyperparameters (``SM_HPS``, ``SM_HP_<NAME>``), the hosts and the GPUs.
AWS's SMP scripts read several of them at argparse time with ``os.environ[...]``. Here they point into
one local job folder (``model/``, ``output/data/``, ``checkpoints/``, ``input/config/``) unless given.

Precedence, for every variable: an explicit ``smp-compat`` option, then the value already in the
environment (a job script that exports ``SM_MODEL_DIR`` keeps it), then the local default.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smp_compat.cli.hyperparameters import env_value, split_framework, to_cmd_args
from smp_compat.errors import SMPConfigError

__all__ = [
    "DEFAULT_JOB_DIR",
    "FRAMEWORK_ENV",
    "JOB_DIR_ENV",
    "LOCAL_HOSTS_ENV",
    "TrainingJob",
    "channel_env_name",
    "node_position",
    "parse_channel",
    "prepare_job_dirs",
    "rewrite_paths",
    "training_environment",
]

DEFAULT_JOB_DIR = "smp-compat-job"
"""The job folder, relative to the working directory, when ``--job-dir`` is not given."""

JOB_DIR_ENV = "SMP_COMPAT_JOB_DIR"
"""The job folder when ``--job-dir`` is not given (e.g. set once in a cluster profile)."""

LOCAL_HOSTS_ENV = "SMP_COMPAT_LOCAL_HOSTS"
"""Set to 1 when ``SM_HOSTS`` holds SageMaker-style names made up here (``algo-1``...), not network names."""

FRAMEWORK_ENV = "SM_FRAMEWORK_PARAMS"
"""SageMaker's framework parameters; Hugging Face's Trainer needs ``sagemaker_mpi_enabled`` there for its SMP path."""

FRAMEWORK_MODULE = "sagemaker_pytorch_container.training:main"
"""``SM_FRAMEWORK_MODULE`` in SageMaker's PyTorch containers."""

SAGEMAKER_ROOT = "/opt/ml"
_CHANNEL_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # CreateTrainingJob's ChannelName pattern and length
_CHANNEL_INPUT = {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"}


# ---------------------------------------------------------------- the job


@dataclass(frozen=True)
class TrainingJob:
    """What defines the job's environment; paths absolute. ``explicit`` names the variables options set."""

    job_dir: Path
    model_dir: Path
    output_dir: Path
    checkpoint_dir: Path
    channels: dict[str, Path] = field(default_factory=dict)
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    entry_point: Path | None = None
    source_dir: Path | None = None
    nnodes: int = 1
    node_rank: int = 0
    num_gpus: int = 0
    instance_type: str | None = None
    job_name: str = "smp-compat-job"
    log_level: int = 20
    explicit: frozenset[str] = frozenset()

    @property
    def hosts(self) -> list[str]:
        """SageMaker's host names, ``algo-1`` ... ``algo-N``, one per node."""
        return [f"algo-{i + 1}" for i in range(self.nnodes)]

    @property
    def script_hyperparameters(self) -> dict[str, Any]:
        """The hyperparameters the script gets as arguments (not the ``sagemaker_*`` ones)."""
        return split_framework(self.hyperparameters)[0]

    def script_args(self) -> list[str]:
        """The hyperparameters as ``--name value`` arguments, as SageMaker gives them (SageMaker paths made local)."""
        return to_cmd_args({k: rewrite_paths(self, v) for k, v in self.script_hyperparameters.items()})


# ---------------------------------------------------------------- channels and paths


def channel_env_name(name: str) -> str:
    """``SM_CHANNEL_<NAME>``: the toolkit upper-cases the name and keeps everything else."""
    return f"SM_CHANNEL_{name.upper()}"


def parse_channel(value: str) -> tuple[str, Path]:
    """``--channel NAME=DIR``: a name SageMaker accepts and an existing local directory."""
    name, sep, directory = value.partition("=")
    if not sep or not directory.strip():
        raise SMPConfigError(
            f"--channel {value!r} must be NAME=DIR (e.g. --channel train=/data/train): the channel name, '=', "
            "then the local directory that holds its files."
        )
    check_channel_name(name, f"--channel {value!r}")
    if directory.startswith("s3://"):
        raise SMPConfigError(
            f"--channel {value!r} names an S3 location; smp-compat reads local files only. Copy the data "
            f"(e.g. `aws s3 sync {directory} /data/{name}`) and pass --channel {name}=/data/{name}."
        )
    path = Path(directory.removeprefix("file://")).expanduser().resolve()
    if not path.is_dir():
        raise SMPConfigError(
            f"--channel {value!r}: the directory {str(path)!r} does not exist. Pass the local directory that "
            f"holds channel {name!r}'s files."
        )
    return name, path


def check_channel_name(name: str, where: str) -> None:
    """SageMaker's rule for channel names: 1-64 letters, digits, '.', '-' or '_'."""
    if not _CHANNEL_NAME.fullmatch(name):
        raise SMPConfigError(
            f"{where}: channel name {name!r} is not one SageMaker accepts: use 1 to 64 letters, digits, '.', "
            "'-' or '_' (e.g. train, test)."
        )


def rewrite_paths(job: TrainingJob, value: Any) -> Any:
    """A hyperparameter naming a SageMaker path (``/opt/ml/checkpoints``...) gets the local one instead."""
    if not isinstance(value, str) or not value.startswith(SAGEMAKER_ROOT + "/"):
        return value
    for sm_path, local in _path_map(job):
        if value == sm_path or value.startswith(sm_path + "/"):
            return str(local) + value[len(sm_path):]
    return value


def _path_map(job: TrainingJob) -> list[tuple[str, Path]]:
    """SageMaker's container paths and their local stand-ins, longest first."""
    pairs = [(f"{SAGEMAKER_ROOT}/input/data/{name}", path) for name, path in job.channels.items()]
    pairs += [
        (f"{SAGEMAKER_ROOT}/checkpoints", job.checkpoint_dir),
        (f"{SAGEMAKER_ROOT}/model", job.model_dir),
        (f"{SAGEMAKER_ROOT}/output", job.output_dir),
        (f"{SAGEMAKER_ROOT}/input", job.job_dir / "input"),
    ]
    if job.source_dir is not None:
        pairs.append((f"{SAGEMAKER_ROOT}/code", job.source_dir))
    return sorted(pairs, key=lambda pair: -len(pair[0]))


# ---------------------------------------------------------------- hosts


def node_position(environ: Mapping[str, str], nnodes: int | None, node_rank: int | None) -> tuple[int, int]:
    """(nodes, this node's index): the launcher's options first, then a Slurm step's or Open MPI's variables."""
    found = _slurm_position(environ) or _mpi_position(environ)
    count = nnodes if nnodes is not None else (found[0] if found else 1)
    index = node_rank if node_rank is not None else (found[1] if found and found[0] == count else 0)
    if not 0 <= index < count:
        raise SMPConfigError(
            f"Node rank {index} is outside the {count} node(s) of this job; pass --node-rank between 0 and "
            f"{count - 1} (or fix --nnodes)."
        )
    return count, index


def _int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _slurm_position(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``SLURM_NNODES`` (or ``SLURM_JOB_NUM_NODES``) and ``SLURM_NODEID``."""
    count = _int(environ, "SLURM_NNODES") or _int(environ, "SLURM_JOB_NUM_NODES")
    index = _int(environ, "SLURM_NODEID")
    return (count, index) if count and index is not None else None


def _mpi_position(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """Open MPI fills node after node: node index = rank // processes per node."""
    rank, size = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
    local = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if rank is None or not size or not local:
        return None
    return max(size // local, 1), rank // local


def _network_interface(environ: Mapping[str, str]) -> str:
    """The interface the collectives are told to use, else the first that is not loopback."""
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = environ.get(name, "").split(",")[0].strip()
        if value and not value.startswith(("^", "=")):
            return value
    route = _default_route_interface()
    if route is not None:
        return route
    try:
        names = [name for _, name in socket.if_nameindex() if name != "lo"]
    except OSError:
        names = []
    return names[0] if names else "lo"


def _default_route_interface() -> str | None:
    """The interface of the default route (Linux ``/proc/net/route``), where other hosts are reached."""
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 1 and fields[1] == "00000000":
            return fields[0]
    return None


# ---------------------------------------------------------------- the variables


def training_environment(job: TrainingJob, environ: Mapping[str, str]) -> dict[str, str]:
    """The ``SM_*`` variables to add to ``environ`` (those already there are kept unless an option set them)."""
    ours = _own_values(job, environ)
    final = {k: environ[k] if k in environ and k not in job.explicit else v for k, v in ours.items()}
    final["SM_RESOURCE_CONFIG"] = _keep(environ, job, "SM_RESOURCE_CONFIG", env_value(_resource_config(final)))
    final["SM_TRAINING_ENV"] = _keep(environ, job, "SM_TRAINING_ENV", env_value(_training_env(job, final)))
    updates = {k: v for k, v in final.items() if environ.get(k) != v}
    if "SM_HOSTS" in updates:
        updates[LOCAL_HOSTS_ENV] = "1"
    return updates


def _keep(environ: Mapping[str, str], job: TrainingJob, name: str, value: str) -> str:
    return environ[name] if name in environ and name not in job.explicit else value


def _own_values(job: TrainingJob, environ: Mapping[str, str]) -> dict[str, str]:
    """Every variable as this job defines it, before the environment's own values are kept."""
    hps = {k: rewrite_paths(job, v) for k, v in job.script_hyperparameters.items()}
    values: dict[str, Any] = {
        "SM_MODEL_DIR": str(job.model_dir),
        "SM_OUTPUT_DIR": str(job.output_dir),
        "SM_OUTPUT_DATA_DIR": str(job.output_dir / "data"),
        "SM_OUTPUT_INTERMEDIATE_DIR": str(job.output_dir / "intermediate"),
        "SM_INPUT_DIR": str(job.job_dir / "input"),
        "SM_INPUT_CONFIG_DIR": str(job.job_dir / "input" / "config"),
        "SM_CHANNELS": sorted(job.channels),
        "SM_INPUT_DATA_CONFIG": {name: dict(_CHANNEL_INPUT) for name in job.channels},
        "SM_HPS": hps,
        "SM_USER_ARGS": to_cmd_args(hps),
        "SM_NUM_GPUS": job.num_gpus,
        "SM_NUM_CPUS": os.cpu_count() or 1,
        "SM_HOSTS": job.hosts,
        "SM_CURRENT_HOST": job.hosts[job.node_rank],
        "SM_LOG_LEVEL": job.log_level,
        "SM_NETWORK_INTERFACE_NAME": _network_interface(environ),
        "SM_FRAMEWORK_MODULE": FRAMEWORK_MODULE,
    }
    if job.entry_point is not None:
        values["SM_USER_ENTRY_POINT"] = job.entry_point.name
        values["SM_MODULE_NAME"] = job.entry_point.name.removesuffix(".py")
        values["SM_MODULE_DIR"] = str(job.source_dir or job.entry_point.parent)
    if job.instance_type is not None:
        values["SM_CURRENT_INSTANCE_TYPE"] = job.instance_type
    for name, path in job.channels.items():
        values[channel_env_name(name)] = str(path)
    for key, value in hps.items():
        values[f"SM_HP_{key.upper()}"] = value
    return {name: env_value(value) for name, value in values.items()}


def _json_or(text: str, fallback: Any) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return fallback


def _resource_config(final: Mapping[str, str]) -> dict[str, Any]:
    """``resourceconfig.json``'s content: this host, all hosts, the interface."""
    return {
        "current_host": final["SM_CURRENT_HOST"],
        "hosts": _json_or(final["SM_HOSTS"], []),
        "network_interface_name": final["SM_NETWORK_INTERFACE_NAME"],
    }


def _training_env(job: TrainingJob, final: Mapping[str, str]) -> dict[str, Any]:
    """``SM_TRAINING_ENV``: the toolkit's Environment as one JSON dict, from the final values."""
    hosts = _json_or(final["SM_HOSTS"], [])
    channels = _json_or(final["SM_CHANNELS"], [])
    return {
        "additional_framework_parameters": split_framework(job.hyperparameters)[1],
        "channel_input_dirs": {name: final.get(channel_env_name(name), "") for name in channels},
        "current_host": final["SM_CURRENT_HOST"],
        "framework_module": final["SM_FRAMEWORK_MODULE"],
        "hosts": hosts,
        "hyperparameters": _json_or(final["SM_HPS"], {}),
        "input_config_dir": final["SM_INPUT_CONFIG_DIR"],
        "input_data_config": _json_or(final["SM_INPUT_DATA_CONFIG"], {}),
        "input_dir": final["SM_INPUT_DIR"],
        "is_master": bool(hosts) and final["SM_CURRENT_HOST"] == hosts[0],
        "job_name": job.job_name,
        "log_level": _json_or(final["SM_LOG_LEVEL"], 20),
        "master_hostname": hosts[0] if hosts else final["SM_CURRENT_HOST"],
        "model_dir": final["SM_MODEL_DIR"],
        "module_dir": final.get("SM_MODULE_DIR", ""),
        "module_name": final.get("SM_MODULE_NAME", ""),
        "network_interface_name": final["SM_NETWORK_INTERFACE_NAME"],
        "num_cpus": _json_or(final["SM_NUM_CPUS"], 1),
        "num_gpus": _json_or(final["SM_NUM_GPUS"], 0),
        "output_data_dir": final["SM_OUTPUT_DATA_DIR"],
        "output_dir": final["SM_OUTPUT_DIR"],
        "output_intermediate_dir": final["SM_OUTPUT_INTERMEDIATE_DIR"],
        "resource_config": _json_or(final["SM_RESOURCE_CONFIG"], {}),
        "user_entry_point": final.get("SM_USER_ENTRY_POINT", ""),
    }


# ---------------------------------------------------------------- the folders


def prepare_job_dirs(job: TrainingJob, env: Mapping[str, str]) -> None:
    """Create the folders the variables name, and ``input/config/*.json`` as SageMaker writes them."""
    for name in ("SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR", "SM_OUTPUT_INTERMEDIATE_DIR"):
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    job.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    config = Path(env["SM_INPUT_CONFIG_DIR"])
    config.mkdir(parents=True, exist_ok=True)
    hps = {k: json.dumps(v) for k, v in job.hyperparameters.items()}  # the SDK's encoding
    files = {
        "hyperparameters.json": hps,
        "inputdataconfig.json": _json_or(env["SM_INPUT_DATA_CONFIG"], {}),
        "resourceconfig.json": _json_or(env["SM_RESOURCE_CONFIG"], {}),
    }
    for name, content in files.items():
        (config / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n", encoding="utf-8")
