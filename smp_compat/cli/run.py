"""``smp-compat run``: launch an unmodified SMP v1 script under torchrun with the shim and its config."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from smp_compat.cli.estimator import Estimator, ignored_warning
from smp_compat.cli.json_args import json_text
from smp_compat.cli.restarts import restart_environment
from smp_compat.cli.job_options import JOB_VALUED, add_job_options, build_job
from smp_compat.cli.run_job import ESTIMATOR_FLAG, job_environment, parse_argv, print_job, rewrite_notes
from smp_compat.cli.sm_env import FRAMEWORK_ENV, TrainingJob, node_position, prepare_job_dirs
from smp_compat.globalstate import BIND_ENV
from smp_compat.config import ENV_VAR, SMPConfig, extract_mp_parameters, parse_json, resolve_config
from smp_compat.errors import SMPConfigError
from smp_compat.heap import TRIM_BYTES, TUNE_MALLOC_ENV
from smp_compat.checkpoints.load_policy import TRUST_ENV, TRUST_FLAG, trust_value
from smp_compat.shim import pythonpath_with_shim
from smp_compat.topology import Topology

__all__ = [
    "FRAMEWORK_ENV",
    "LaunchConfig",
    "LaunchPlan",
    "launch_environment",
    "note",
    "plan_launch",
    "read_launch_config",
    "resolve_launch",
    "run_command",
]

BIND_FLAG = "--bind-cores"
"""Pin each local rank to its own share of the cores (exported as ``SMP_COMPAT_BIND_CORES=1``)."""

TUNE_MALLOC_FLAG = "--tune-malloc"
"""Keep freed memory in each process's heap (exported as ``SMP_COMPAT_TUNE_MALLOC=1``; ``--no-tune-malloc``: ``0``)."""


_OWN_FLAGS = ("--dry-run", BIND_FLAG, TUNE_MALLOC_FLAG, "--no-" + TUNE_MALLOC_FLAG[2:])
_OWN_VALUED = ("--config", TRUST_FLAG, ESTIMATOR_FLAG, *JOB_VALUED)
_NPROC_OPTIONS = ("--nproc-per-node", "--nproc_per_node")
_NNODES_OPTIONS = ("--nnodes",)
_NODE_RANK_OPTIONS = ("--node-rank", "--node_rank")
_TABLE_COLUMNS = ("rank", "pp_rank", "tp_rank", "rdp_rank", "dp_rank", "mp_rank")
_GROUP_AXES = ("pp", "tp", "rdp", "dp", "mp")


# ---------------------------------------------------------------- the launch config


@dataclass(frozen=True)
class LaunchConfig:
    """What ``--config`` (or an inherited SM_HP_MP_PARAMETERS) says; ``parameters`` is None when nothing did."""

    parameters: dict[str, Any] | None
    processes_per_host: int | None
    source: str
    notes: tuple[str, ...] = ()


def _load_config_value(value: str) -> tuple[Any, str]:
    """``--config`` is inline JSON when it starts with ``{``, else a path to a JSON file."""
    text, source = json_text(value, "--config", '{"microbatches": 2}')
    return parse_json(text, source), source


def _mpi_section(raw: Any) -> tuple[int | None, tuple[str, ...]]:
    """``processes_per_host`` from a distribution dict's ``mpi`` section (the default --nproc-per-node)."""
    mpi = raw.get("mpi") if isinstance(raw, Mapping) and ("smdistributed" in raw or "modelparallel" in raw) else None
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
    if isinstance(raw, Mapping) and ("smdistributed" in raw or "modelparallel" in raw):
        return {k: v for k, v in raw.items() if k != "mpi"}
    return raw


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
        raw, source = _load_config_value(value)
    return launch_config_from(raw, source)


def launch_config_from(raw: Any, source: str) -> LaunchConfig:
    """A distribution dict (or its modelparallel part, or bare parameters) already parsed."""
    count, notes = _mpi_section(raw)
    return LaunchConfig(extract_mp_parameters(_without_mpi(raw)), count, source, notes)


def launch_environment(launch: LaunchConfig, cfg: SMPConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the launched processes get on top of ``environ``: config, framework params, shim path,
    and what makes torch elastic's restarts work (``restarts.py``).

    ``partitions`` (SMP's old name for the pipeline degree) is always added to the parameters: SageMaker's
    SDK required it, and Hugging Face's ``is_sagemaker_mp_enabled()`` looks for it.
    """
    env = {
        "PYTHONPATH": pythonpath_with_shim(environ.get("PYTHONPATH")),
        FRAMEWORK_ENV: json.dumps(_framework_params(environ.get(FRAMEWORK_ENV))),
        "PYTHONWARNINGS": _with_warning_filter(environ.get("PYTHONWARNINGS")),
    }
    if launch.parameters is not None:
        env[ENV_VAR] = json.dumps({**launch.parameters, "partitions": cfg.pipeline_parallel_degree})
    env.update(restart_environment(environ))
    return env


_NUMPY_NOTICE = "ignore:Failed to initialize NumPy"


def _with_warning_filter(current: str | None) -> str:
    """torch without numpy warns about it in every process at import; numpy is not needed here."""
    return f"{current},{_NUMPY_NOTICE}" if current else _NUMPY_NOTICE


def _framework_params(current: str | None) -> dict[str, Any]:
    """Keep any framework params already set (when they are a JSON dict) and turn MPI on."""
    try:
        params = json.loads(current) if current else {}
    except json.JSONDecodeError:
        params = {}
    if not isinstance(params, dict):
        params = {}
    return {**params, "sagemaker_mpi_enabled": True}


def resolve_launch(launch: LaunchConfig) -> SMPConfig:
    """Validate the launch config on its own (the launcher cannot see the script's smp.init dict)."""
    try:
        return resolve_config(launch.parameters or {}, environ={})
    except SMPConfigError as exc:
        raise SMPConfigError(
            f"{exc}\n(From {launch.source}. The launcher checks it on its own, so give the complete SMP "
            "parameters there; its keys override those of the script's smp.init dict, as on SageMaker.)"
        ) from None


# ---------------------------------------------------------------- the `run` command line


def _run_parser() -> argparse.ArgumentParser:
    """torchrun's own parser plus our options, so every torchrun option is accepted and passed on."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "smp-compat run"
    parser.description = (
        "Run a training script written for SageMaker's SMP v1 (import smdistributed.modelparallel.torch) "
        "under torchrun, unchanged. Every torchrun option is accepted (spelled in full)."
    )
    parser.allow_abbrev = False  # our options are removed by exact name before torchrun sees the rest
    own = parser.add_argument_group("smp-compat options")
    own.add_argument(
        "--config",
        metavar="JSON_OR_FILE",
        help="SageMaker distribution dict, its modelparallel section, or bare SMP parameters; JSON text or a "
        f"JSON file. Exported as {ENV_VAR}; its mpi.processes_per_host is the default --nproc-per-node.",
    )
    own.add_argument(
        "--dry-run",
        action="store_true",
        help="print the rank layout, groups, environment and command, check the config, start nothing",
    )
    own.add_argument(
        BIND_FLAG,
        action="store_true",
        help="pin each local rank (all its threads) to its own share of the cores this launch may use; "
        f"exported as {BIND_ENV}=1 and applied in smp.init. Off by default.",
    )
    own.add_argument(
        TUNE_MALLOC_FLAG,
        action=argparse.BooleanOptionalAction,
        help="keep freed memory in each process's heap instead of returning it to the OS (glibc), so a step does "
        f"not fault the same pages in again; costs up to {TRIM_BYTES >> 20} MiB of resident memory per thread "
        f"heap. Exported as {TUNE_MALLOC_ENV}=1 (=0 with the no- form) and applied in smp.init. Default: on in "
        "CPU pipelines (pipeline_parallel_degree > 1), whose ranks run microbatches on several threads.",
    )
    own.add_argument(
        TRUST_FLAG,
        action="append",
        default=[],
        metavar="DIR",
        help="load checkpoints under DIR in full (any pickled object, e.g. a transformers config in user_content); "
        f"repeatable. Exported as {TRUST_ENV}. Only for checkpoints you trust.",
    )
    own.add_argument(
        ESTIMATOR_FLAG,
        metavar="FILE",
        help="run the job a sagemaker.pytorch.PyTorch estimator describes: a JSON file of its keyword arguments "
        "(entry_point, source_dir, hyperparameters, distribution, instance_count, instance_type, ...) plus "
        "optional inputs (channel: local dir). Give no script then.",
    )
    add_job_options(parser)
    return parser


def _strip_own_options(tokens: Sequence[str]) -> list[str]:
    """The launcher options minus ours: what torchrun gets."""
    out: list[str] = []
    skip_value = False
    for token in tokens:
        if skip_value:
            skip_value = False
        elif token in _OWN_VALUED:
            skip_value = True
        elif token not in _OWN_FLAGS and not token.startswith(tuple(f"{o}=" for o in _OWN_VALUED)):
            out.append(token)
    return out


def _split_argv(argv: Sequence[str], ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(launcher options, script and its arguments): the script is where torchrun's REMAINDER begins."""
    index = len(argv) - len(ns.training_script_args) - 1
    if index < 0 or argv[index] != ns.training_script:
        raise SMPConfigError(
            f"Cannot tell where the training script starts in {shlex.join(argv)!r}. Write "
            "`smp-compat run [options] script.py [script args]` with every option before the script."
        )
    return list(argv[:index]), list(argv[index:])


def _given(options: Sequence[str], names: Sequence[str], pet: str, environ: Mapping[str, str]) -> bool:
    """Whether the user chose a torchrun option (on the command line or through torchrun's PET_ variable)."""
    named = any(t in names or t.startswith(tuple(f"{o}=" for o in names)) for t in options)
    return named or bool(environ.get(pet))


def _nproc_given(options: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether the user chose --nproc-per-node."""
    return _given(options, _NPROC_OPTIONS, "PET_NPROC_PER_NODE", environ)


def _local_world_size(value: str) -> int | None:
    """torchrun's --nproc-per-node as a number, where it can be known before launch."""
    if value.isdigit():
        return int(value)
    if value == "cpu":
        return os.cpu_count()
    if value in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        return os.cpu_count() if value == "auto" else None
    return None


def _node_count(value: str) -> int | None:
    """torchrun's --nnodes (``N`` or ``MIN:MAX``) as a number, unless it is an elastic range."""
    low, _, high = value.partition(":")
    if not low.isdigit() or (high and high != low):
        return None
    return int(low)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class LaunchPlan:
    """Everything ``smp-compat run`` decided: the exact command, the variables it adds, and the layout."""

    command: list[str]
    env_updates: dict[str, str]
    launch: LaunchConfig
    config: SMPConfig
    nnodes: int | None
    nproc_per_node: int | None
    dry_run: bool
    job: TrainingJob | None = None
    notes: tuple[str, ...] = ()
    cwd: str | None = None

    @property
    def world_size(self) -> int | None:
        """nnodes * nproc_per_node, or None when torchrun decides it at run time."""
        if self.nnodes is None or self.nproc_per_node is None:
            return None
        return self.nnodes * self.nproc_per_node


def _check_script(ns: argparse.Namespace) -> None:
    """A missing script would otherwise fail once per process, buried in torchrun's report."""
    if not ns.module and not ns.no_python and not Path(ns.training_script).is_file():
        raise SMPConfigError(
            f"The training script {ns.training_script!r} does not exist (relative to {os.getcwd()!r}). Pass "
            "the path of your script, or use -m for a module."
        )


def _estimator_launch(ns: argparse.Namespace, estimator: Estimator | None, env: Mapping[str, str]) -> LaunchConfig:
    """--config, or the estimator's distribution (not both), or an inherited SM_HP_MP_PARAMETERS."""
    if estimator is None or estimator.distribution is None:
        return read_launch_config(ns.config, env)
    if ns.config is not None:
        raise SMPConfigError(
            f"Both --config and the \"distribution\" of {estimator.source} give the SMP config; give it once "
            "(drop --config, or the estimator's distribution)."
        )
    return launch_config_from(estimator.distribution, f"{estimator.source} distribution")


def _estimator_options(
    options: list[str], estimator: Estimator | None, launch: LaunchConfig, env: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """(torchrun options with the job's --nnodes and --nproc-per-node where the user gave none, notes)."""
    notes: list[str] = []
    count = launch.processes_per_host
    if count is None and estimator is not None:
        count = estimator.processes_per_host()
        if count is None and not _nproc_given(options, env):
            notes.append(
                f"instance_type {estimator.instance_type!r} is not in smp-compat's table of GPU instances and the "
                "distribution sets no mpi.processes_per_host: pass --nproc-per-node (torchrun's default is 1)"
            )
    if count is not None and not _nproc_given(options, env):
        options = ["--nproc-per-node", str(count), *options]
    if estimator is not None and not _given(options, _NNODES_OPTIONS, "PET_NNODES", env):
        options = ["--nnodes", str(estimator.instance_count), *options]
    return options, notes


def _option_value(options: Sequence[str], names: Sequence[str], default: str) -> str:
    """The last value given to one of ``names`` in ``options`` (``--x v`` or ``--x=v``)."""
    value = default
    for i, token in enumerate(options):
        if token in names and i + 1 < len(options):
            value = options[i + 1]
        elif token.startswith(tuple(f"{n}=" for n in names)):
            value = token.split("=", 1)[1]
    return value


def num_gpus() -> int:
    """GPUs on this host (SM_NUM_GPUS)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _job(
    ns: argparse.Namespace, options: list[str], estimator: Estimator | None, env: Mapping[str, str]
) -> TrainingJob:
    """The SageMaker job: its hosts follow the launcher's node count and node rank."""
    nnodes = node_rank = None
    if _given(options, _NNODES_OPTIONS, "PET_NNODES", env):
        nnodes = _node_count(_option_value(options, _NNODES_OPTIONS, env.get("PET_NNODES") or ns.nnodes))
    if _given(options, _NODE_RANK_OPTIONS, "PET_NODE_RANK", env):
        rank = _option_value(options, _NODE_RANK_OPTIONS, env.get("PET_NODE_RANK") or str(ns.node_rank))
        node_rank = int(rank) if rank.isdigit() else None
    count, index = node_position(env, nnodes, node_rank)
    entry = None if ns.module or ns.no_python else Path(ns.training_script).resolve()
    return build_job(ns, env, nnodes=count, node_rank=index, num_gpus=num_gpus(), entry_point=entry, estimator=estimator)


def plan_launch(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Parse ``smp-compat run`` arguments and decide the torchrun command and its environment (no side effects)."""
    env = os.environ if environ is None else environ
    ns, argv, estimator = parse_argv(_run_parser(), argv)
    options, script = _split_argv(argv, ns)
    _check_script(ns)
    options = _strip_own_options(options)
    launch = _estimator_launch(ns, estimator, env)
    cfg = resolve_launch(launch)
    options, notes = _estimator_options(options, estimator, launch, env)
    if estimator is not None and (warning := ignored_warning(estimator)):
        notes.insert(0, warning)
    job = _job(ns, options, estimator, env)
    notes += rewrite_notes(job)
    script = [script[0], *job.script_args(), *script[1:]]
    command = [sys.executable, "-m", "torch.distributed.run", *options, *script]
    env_updates = launch_environment(launch, cfg, env)
    job_environment(job, estimator, env, env_updates)
    if ns.bind_cores:
        env_updates[BIND_ENV] = "1"
    if ns.tune_malloc is not None:
        env_updates[TUNE_MALLOC_ENV] = "1" if ns.tune_malloc else "0"
    if ns.trust_checkpoint:
        env_updates[TRUST_ENV] = trust_value(ns.trust_checkpoint, env.get(TRUST_ENV))
    nproc = _option_value(options, _NPROC_OPTIONS, ns.nproc_per_node)
    return LaunchPlan(
        command=command,
        env_updates=env_updates,
        launch=launch,
        config=cfg,
        nnodes=_node_count(_option_value(options, _NNODES_OPTIONS, ns.nnodes)),
        nproc_per_node=_local_world_size(nproc),
        dry_run=ns.dry_run,
        job=job,
        notes=tuple(notes),
        cwd=str(job.source_dir or job.entry_point.parent) if estimator is not None and job.entry_point else None,
    )


def _world_size_problem(plan: LaunchPlan) -> str | None:
    """The launch config checked against the world size, as a message (None when fine or unknowable)."""
    if plan.world_size is None or plan.launch.parameters is None:
        return None
    try:
        plan.config.check_world_size(plan.world_size)
    except SMPConfigError as exc:
        return (
            f"{exc} (World size {plan.world_size} = {plan.nnodes} node(s) x {plan.nproc_per_node} process(es); "
            f"config from {plan.launch.source}. smp.init will fail the same way unless the script's own "
            "smp.init dict supplies the missing keys.)"
        )
    return None


# ---------------------------------------------------------------- output


def _console() -> Console:
    return Console(markup=False, highlight=False, soft_wrap=False)


def note(text: str) -> None:
    print(f"smp-compat: {text}", file=sys.stderr)


def _layout_tables(topology: Topology) -> tuple[Table, Table]:
    """One row per rank with every coordinate, and every group's members per axis."""
    ranks = Table(title="Ranks", box=box.SIMPLE)
    for column in _TABLE_COLUMNS:
        ranks.add_column(column, justify="right")
    for c in topology.table():
        ranks.add_row(*(str(getattr(c, column)) for column in _TABLE_COLUMNS))
    groups = Table(title="Groups", box=box.SIMPLE)
    groups.add_column("axis")
    groups.add_column("groups", overflow="fold")
    for axis in _GROUP_AXES:
        groups.add_row(axis, " ".join(str(members) for members in topology.all_groups(axis)))
    return ranks, groups


def _print_dry_run(plan: LaunchPlan) -> None:
    """Tables through rich; the header, environment and command as plain lines, never wrapped (copy-paste)."""
    cfg = plan.config
    if plan.world_size is None:
        print(
            f"World size unknown before launch (--nnodes {plan.nnodes or 'range'}, --nproc-per-node "
            f"{plan.nproc_per_node or '?'}): no layout shown. Pass fixed numbers to see it."
        )
    else:
        topology = Topology.build(
            plan.world_size, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.placement_strategy
        )
        print(
            f"World size {plan.world_size} = {plan.nnodes} node(s) x {plan.nproc_per_node} process(es) per node; "
            f"pipeline_parallel_degree {cfg.pipeline_parallel_degree}, tensor_parallel_degree "
            f"{cfg.tensor_parallel_degree}, placement_strategy {cfg.placement_strategy!r} ({topology.placement})."
        )
        console = _console()
        for table in _layout_tables(topology):
            console.print(table)
        print("Groups list global ranks; entry i of a group has group rank i.")
    if plan.launch.parameters is None:
        print("No launch config: the script's smp.init(...) dict decides (layout shown for the defaults).")
    if plan.job is not None:
        print_job(plan.job, plan.env_updates, plan.cwd)
    print("Environment added for every process:")
    for name, value in sorted(plan.env_updates.items()):
        print(f"  {name}={value}")
    print("Command:")
    print("  " + shlex.join(plan.command))


# ---------------------------------------------------------------- the command


def run_command(argv: list[str]) -> int:
    """``smp-compat run``: check, then exec torchrun (or, with --dry-run, show the plan and stop)."""
    plan = plan_launch(argv)
    for line in (*plan.launch.notes, *plan.notes):
        note(line)
    problem = _world_size_problem(plan)
    if plan.dry_run:
        _print_dry_run(plan)
        if problem:
            raise SMPConfigError(problem)
        return 0
    if problem:
        note(f"warning: {problem}")
    if plan.job is not None:
        prepare_job_dirs(plan.job, {**os.environ, **plan.env_updates})
    if plan.cwd is not None:
        os.chdir(plan.cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, plan.command, {**os.environ, **plan.env_updates})
    return 0  # not reached: execve replaces this process
