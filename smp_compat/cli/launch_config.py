"""The SMP config of a launch (``smp-compat run``, ``env``, ``plan``): where it comes from, which SMP it is for,
and the variables it becomes in every process.

One reader for ``--config`` (inline JSON or a file: a SageMaker distribution dict, its modelparallel part, or
bare parameters), the estimator's ``distribution``, or an ``SM_HP_MP_PARAMETERS`` already exported. Where the
SMP major version is decided (``smp_major``) and where each version's part of the launch plugs in
(``resolve_smp``: v1's is ``launch_v1.V1Launch``, v2's ``launch_v2.V2Launch``) is here and nowhere else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from smp_compat.cli.estimator import Estimator
from smp_compat.cli.json_args import json_text
from smp_compat.cli.launch_v1 import V1Launch
from smp_compat.cli.launch_v2 import V2Launch
from smp_compat.cli.restarts import restart_environment
from smp_compat.cli.script_major import script_imports
from smp_compat.cli.sm_env import FRAMEWORK_ENV
from smp_compat.config import ENV_VAR, extract_mp_parameters, parse_json
from smp_compat.errors import SMPConfigError
from smp_compat.shim import pythonpath_with_shim

__all__ = [
    "SMP_V1",
    "SMP_V2",
    "LaunchConfig",
    "SMPLaunch",
    "choose_launch_config",
    "launch_config_from",
    "launch_environment",
    "read_launch_config",
    "resolve_smp",
    "smp_major",
    "with_script_major",
]

SMP_V1 = 1
"""``smdistributed.modelparallel.torch``, launched by MPI on SageMaker (``mpi`` in the distribution)."""

SMP_V2 = 2
"""``torch.sagemaker``, launched by torchrun on SageMaker (``torch_distributed`` in the distribution)."""

_NUMPY_NOTICE = "ignore:Failed to initialize NumPy"


@dataclass(frozen=True)
class LaunchConfig:
    """What ``--config`` (or an inherited SM_HP_MP_PARAMETERS) says; ``parameters`` is None when nothing did."""

    parameters: dict[str, Any] | None
    processes_per_host: int | None
    source: str
    notes: tuple[str, ...] = ()
    major: int = SMP_V1


class SMPLaunch(Protocol):
    """One SMP major version's part of a launch, built from the launch config by ``resolve_smp``."""

    launch: LaunchConfig

    def exported_parameters(self) -> dict[str, Any] | None:
        """What SM_HP_MP_PARAMETERS carries to every process (None: nothing, the script's own dict decides)."""
        ...

    def world_size_problem(self, world_size: int, nnodes: int | None, nproc_per_node: int | None) -> str | None:
        """The config checked against the world size, as a message (None when fine)."""
        ...

    def print_layout(self, world_size: int, nnodes: int | None, nproc_per_node: int | None) -> None:
        """``--dry-run``: every rank's coordinates and every group, for this world size."""
        ...


# ---------------------------------------------------------------- where the config comes from


def choose_launch_config(option: str | None, estimator: Estimator | None, environ: Mapping[str, str]) -> LaunchConfig:
    """--config, or the estimator's distribution (not both), or an inherited SM_HP_MP_PARAMETERS."""
    if estimator is None or estimator.distribution is None:
        return read_launch_config(option, environ)
    if option is not None:
        raise SMPConfigError(
            f"Both --config and the \"distribution\" of {estimator.source} give the SMP config; give it once "
            "(drop --config, or the estimator's distribution)."
        )
    return launch_config_from(estimator.distribution, f"{estimator.source} distribution")


def read_launch_config(value: str | None, environ: Mapping[str, str]) -> LaunchConfig:
    """Read ``--config`` (JSON text or file; distribution dict, its modelparallel part, or bare parameters).

    Without ``--config``, an SM_HP_MP_PARAMETERS already in the environment is the config; without
    either, the launcher sets no parameters and the script's own ``smp.init(...)`` dict decides.
    """
    if value is None:
        inherited = environ.get(ENV_VAR, "")
        if not inherited.strip():
            return LaunchConfig(None, None, "none")
        raw, source = parse_json(inherited, ENV_VAR), f"{ENV_VAR} (inherited)"
    else:
        text, source = json_text(value, "--config", '{"microbatches": 2}')
        raw = parse_json(text, source)
    return launch_config_from(raw, source)


def launch_config_from(raw: Any, source: str) -> LaunchConfig:
    """A distribution dict (or its modelparallel part, or bare parameters) already parsed."""
    count, notes = _mpi_section(raw)
    return LaunchConfig(extract_mp_parameters(_without_mpi(raw)), count, source, notes, smp_major(raw))


def _is_distribution(raw: Any) -> bool:
    return isinstance(raw, Mapping) and ("smdistributed" in raw or "modelparallel" in raw)


def _mpi_section(raw: Any) -> tuple[int | None, tuple[str, ...]]:
    """``processes_per_host`` from a distribution dict's ``mpi`` section (the default --nproc-per-node)."""
    mpi = raw.get("mpi") if _is_distribution(raw) else None
    if mpi is None:
        return None, ()
    if not isinstance(mpi, Mapping):
        raise SMPConfigError(
            f'The distribution dict\'s "mpi" entry must be a dict, got {mpi!r:.80}; write '
            '"mpi": {"enabled": true, "processes_per_host": N}.'
        )
    count = mpi.get("processes_per_host")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise SMPConfigError(
            f'"mpi"."processes_per_host" must be a positive int, got {count!r}; set it to the number of '
            "processes per node (one per GPU), or leave it out and pass --nproc-per-node."
        )
    notes: tuple[str, ...] = ()
    if mpi.get("custom_mpi_options"):
        notes = ('ignoring "mpi"."custom_mpi_options": processes are started by torchrun, not mpirun',)
    return count, notes


def _without_mpi(raw: Any) -> Any:
    """The distribution dict minus its ``mpi`` section, which is not an SMP parameter."""
    if _is_distribution(raw):
        return {k: v for k, v in raw.items() if k != "mpi"}
    return raw


# ---------------------------------------------------------------- which SMP: the one place versions part ways


_V2_ONLY_KEYS = frozenset({
    "hybrid_shard_degree", "sm_activation_offloading", "fsdp_cache_flush_warnings", "allow_empty_shards",
    "context_parallel_degree", "expert_parallel_degree", "random_seed",
})  # fmt: skip
"""SMP v2 keys SMP v1 never had: bare parameters with one of them are for v2."""


def smp_major(raw: Any) -> int:
    """The SMP major version a parsed config is for: SageMaker's SDK's own rule.

    The SDK picks an SMP v2 container when the distribution has both ``torch_distributed`` and
    ``smdistributed``'s ``modelparallel``; v1's has ``mpi`` instead. Bare parameters (no distribution dict,
    as in an inherited SM_HP_MP_PARAMETERS, or the ``modelparallel`` part alone) are v2's when they hold a
    key only v2 has (``hybrid_shard_degree``, ...), else v1's.
    """
    section = raw.get("smdistributed") if _is_distribution(raw) else None
    if isinstance(section, Mapping) and "modelparallel" in section and "torch_distributed" in raw:
        return SMP_V2
    if section is None and _V2_ONLY_KEYS & set(extract_mp_parameters(_without_mpi(raw))):
        return SMP_V2
    return SMP_V1


def with_script_major(launch: LaunchConfig, script: str | Path) -> LaunchConfig:
    """With no config at all, the SMP the script imports: ``torch.sagemaker`` (in it or a module of its own
    beside it) and no ``smdistributed.modelparallel`` makes the launch SMP v2's; otherwise v1's, as before."""
    path = Path(script)
    if launch.source != "none" or not path.is_file():
        return launch
    found = script_imports(path)
    if found.v2 is None or found.v1 is not None:
        return launch
    note = f"no SMP config given; {path.name} imports torch.sagemaker ({found.v2}): launching it as SMP v2"
    return replace(launch, major=SMP_V2, notes=(*launch.notes, note))


def resolve_smp(launch: LaunchConfig) -> SMPLaunch:
    """The launch config checked by its SMP version's rules (on its own: the script's dict is not visible here)."""
    if launch.major == SMP_V1:
        return V1Launch.resolve(launch)
    return V2Launch.resolve(launch)


# ---------------------------------------------------------------- the variables every process gets


def launch_environment(smp: SMPLaunch, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the launched processes get on top of ``environ``: config, framework params, shim path,
    and what makes torch elastic's restarts work (``restarts.py``)."""
    env = {
        "PYTHONPATH": pythonpath_with_shim(environ.get("PYTHONPATH")),
        FRAMEWORK_ENV: json.dumps(_framework_params(environ.get(FRAMEWORK_ENV), smp.launch.major)),
        "PYTHONWARNINGS": _with_warning_filter(environ.get("PYTHONWARNINGS")),
    }
    parameters = smp.exported_parameters()
    if parameters is not None:
        env[ENV_VAR] = json.dumps(parameters)
    env.update(restart_environment(environ))
    return env


def _with_warning_filter(current: str | None) -> str:
    """torch without numpy warns about it in every process at import; numpy is not needed here."""
    return f"{current},{_NUMPY_NOTICE}" if current else _NUMPY_NOTICE


def _framework_params(current: str | None, major: int) -> dict[str, Any]:
    """Keep any framework params already set (when they are a JSON dict) and name the launcher SageMaker uses:
    MPI for SMP v1 (Hugging Face's Trainer looks for it), torchrun for v2 (the SDK's hyperparameter)."""
    try:
        params = json.loads(current) if current else {}
    except json.JSONDecodeError:
        params = {}
    if not isinstance(params, dict):
        params = {}
    if major == SMP_V2:
        return {**params, "sagemaker_torch_distributed_enabled": True}
    return {**params, "sagemaker_mpi_enabled": True}
