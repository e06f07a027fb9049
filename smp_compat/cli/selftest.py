"""``smp-compat selftest``: launch ``python -m smp_compat.selftest`` exactly as ``smp-compat run`` launches a script.

Same launcher (torchrun, every torchrun option accepted), same shim on PYTHONPATH, same config handling
(``--config`` is exported as SM_HP_MP_PARAMETERS, and its ``mpi.processes_per_host`` is the default
``--nproc-per-node``); the ranks take that config aside and run it as the ``user-config`` check.
"""

from __future__ import annotations

import argparse
import os
import sys

from smp_compat.cli.run import run_command
from smp_compat.selftest.checks import CHECKS, USER_CHECK, select
from smp_compat.selftest.worker import add_options

__all__ = ["selftest_command"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smp-compat selftest",
        description="Check that smp_compat trains correctly on this machine or cluster: a battery of tiny "
        "trainings (data, pipeline, tensor and sharded data parallelism, fp16/bf16, activation checkpointing, "
        "checkpoints, and your --config), each compared with the same training in one process. Every other "
        "option is passed to torchrun, as by `smp-compat run` (e.g. --nproc-per-node 8, --nnodes, "
        "--rdzv-endpoint). Under Slurm or MPI: eval \"$(smp-compat env [--config ...])\" and launch "
        "`python -m smp_compat.selftest [options]` on every rank.",
        allow_abbrev=False,
    )
    add_options(parser)
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    return parser


def _list_checks() -> None:
    for check in (*CHECKS, USER_CHECK):
        print(f"{check.name:<26} {check.about}")


def selftest_command(argv: list[str]) -> int:
    """Parse our options, check them here (before any process starts), and exec torchrun on the worker module."""
    ns, launcher = _parser().parse_known_args(argv)
    if ns.list:
        _list_checks()
        return 0
    names = [n.strip() for n in ns.checks.split(",") if n.strip()] if ns.checks else None
    has_config = "--config" in launcher or any(t.startswith("--config=") for t in launcher) or bool(
        os.environ.get("SM_HP_MP_PARAMETERS", "").strip())  # fmt: skip
    select(names, has_config)  # an unknown name fails here, not once per rank
    worker = []
    if ns.json:
        worker += ["--json", os.path.abspath(ns.json)]
    if ns.checks:
        worker += ["--checks", ns.checks]
    if ns.checkpoint_dir:
        worker += ["--checkpoint-dir", os.path.abspath(ns.checkpoint_dir)]
    worker += ["--check-timeout", str(ns.check_timeout)]
    sys.stdout.flush()
    return run_command([*launcher, "-m", "smp_compat.selftest", *worker])
