"""The command line of ``smp-compat run``: our options, torchrun's options, and the script (or ``--estimator``'s).

torchrun's own parser plus ours, so every torchrun option is accepted; ours are removed by exact name before
torchrun sees the rest. The helpers at the end read torchrun's options the way torchrun does (``--x v``,
``--x=v``, or its ``PET_*`` variable) for the decisions made before launch: processes per node, nodes, node rank.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from smp_compat.checkpoints.load_policy import TRUST_ENV, TRUST_FLAG
from smp_compat.cli.estimator import Estimator, read_estimator
from smp_compat.cli.job_options import JOB_VALUED, add_job_options
from smp_compat.config import ENV_VAR
from smp_compat.errors import SMPConfigError
from smp_compat.globalstate import BIND_ENV
from smp_compat.host.cuda_on_cpu import CPU_CUDA_ENV
from smp_compat.host.heap import TRIM_BYTES, TUNE_MALLOC_ENV

__all__ = [
    "BIND_FLAG",
    "CPU_CUDA_FLAG",
    "ESTIMATOR_FLAG",
    "NNODES_OPTIONS",
    "NODE_RANK_OPTIONS",
    "NPROC_OPTIONS",
    "TUNE_MALLOC_FLAG",
    "RunArgs",
    "given",
    "local_world_size",
    "node_count",
    "option_value",
    "parse_run_argv",
]

BIND_FLAG = "--bind-cores"
"""Pin each local rank to its own share of the cores (exported as ``SMP_COMPAT_BIND_CORES=1``)."""

TUNE_MALLOC_FLAG = "--tune-malloc"
"""Keep freed memory in each process's heap (exported as ``SMP_COMPAT_TUNE_MALLOC=1``; ``--no-tune-malloc``: ``0``)."""

CPU_CUDA_FLAG = "--cpu-cuda"
"""Serve the script's torch.cuda calls on a machine without CUDA (the default; ``--no-cpu-cuda``: ``SMP_COMPAT_CPU_CUDA=0``)."""

ESTIMATOR_FLAG = "--estimator"
"""``smp-compat run --estimator FILE``: the job a ``sagemaker.pytorch.PyTorch`` estimator describes."""

NPROC_OPTIONS = ("--nproc-per-node", "--nproc_per_node")
NNODES_OPTIONS = ("--nnodes",)
NODE_RANK_OPTIONS = ("--node-rank", "--node_rank")

_OWN_FLAGS = ("--dry-run", BIND_FLAG, TUNE_MALLOC_FLAG, "--no-" + TUNE_MALLOC_FLAG[2:], CPU_CUDA_FLAG,
              "--no-" + CPU_CUDA_FLAG[2:])  # fmt: skip
_OWN_VALUED = ("--config", TRUST_FLAG, ESTIMATOR_FLAG, *JOB_VALUED)
_PLACEHOLDER = "<the estimator's entry_point>"


@dataclass(frozen=True)
class RunArgs:
    """The parsed command line: our options (``ns``), what torchrun gets, the script and its arguments."""

    ns: argparse.Namespace
    torchrun_options: list[str]
    script: list[str]
    estimator: Estimator | None


def parse_run_argv(argv: Sequence[str]) -> RunArgs:
    """Parse ``smp-compat run``'s arguments; the script must exist (else it fails once per process, later)."""
    ns, argv, estimator = _parse_with_estimator(_run_parser(), argv)
    options, script = _split_argv(argv, ns)
    _check_script(ns)
    return RunArgs(ns, _strip_own_options(options), script, estimator)


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
        CPU_CUDA_FLAG,
        action=argparse.BooleanOptionalAction,
        help="on a machine with no CUDA device, answer the script's own torch.cuda calls that would fail there "
        "(set_device, current_device, device_count -> 1, synchronize, nvtx, cudart profiler, ...) on CPU, each "
        "announced once per process; torch.cuda.is_available() stays False, libraries get torch's own answers, "
        f"and nothing changes where CUDA is available. Default: on; --no-cpu-cuda exports {CPU_CUDA_ENV}=0.",
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


def _parse_with_estimator(
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


def _split_argv(argv: Sequence[str], ns: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(launcher options, script and its arguments): the script is where torchrun's REMAINDER begins."""
    index = len(argv) - len(ns.training_script_args) - 1
    if index < 0 or argv[index] != ns.training_script:
        raise SMPConfigError(
            f"Cannot tell where the training script starts in {shlex.join(argv)!r}. Write "
            "`smp-compat run [options] script.py [script args]` with every option before the script."
        )
    return list(argv[:index]), list(argv[index:])


def _check_script(ns: argparse.Namespace) -> None:
    """A missing script would otherwise fail once per process, buried in torchrun's report."""
    if not ns.module and not ns.no_python and not Path(ns.training_script).is_file():
        raise SMPConfigError(
            f"The training script {ns.training_script!r} does not exist (relative to {os.getcwd()!r}). Pass "
            "the path of your script, or use -m for a module."
        )


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


# ---------------------------------------------------------------- torchrun's options, read as torchrun reads them


def given(options: Sequence[str], names: Sequence[str], pet: str, environ: Mapping[str, str]) -> bool:
    """Whether the user chose a torchrun option (on the command line or through torchrun's PET_ variable)."""
    named = any(t in names or t.startswith(tuple(f"{o}=" for o in names)) for t in options)
    return named or bool(environ.get(pet))


def option_value(options: Sequence[str], names: Sequence[str], default: str) -> str:
    """The last value given to one of ``names`` in ``options`` (``--x v`` or ``--x=v``)."""
    value = default
    for i, token in enumerate(options):
        if token in names and i + 1 < len(options):
            value = options[i + 1]
        elif token.startswith(tuple(f"{n}=" for n in names)):
            value = token.split("=", 1)[1]
    return value


def local_world_size(value: str) -> int | None:
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


def node_count(value: str) -> int | None:
    """torchrun's --nnodes (``N`` or ``MIN:MAX``) as a number, unless it is an elastic range."""
    low, _, high = value.partition(":")
    if not low.isdigit() or (high and high != low):
        return None
    return int(low)
