"""``smp-compat run``: launch an unmodified SMP script under torchrun with the shim, its config and a SageMaker job.

One path, top to bottom in ``plan_launch``:

1. the command line: our options, torchrun's, the script or ``--estimator``'s entry point (``run_args.py``);
2. the SMP config, its major version, and that version's checks (``launch_config.py``; v1: ``launch_v1.py``);
3. the SageMaker job: processes per node and nodes, folders, channels, hyperparameters (``run_job.py``);
4. the torchrun command and the variables every process gets.

``run_command`` then shows the plan (``--dry-run``) or execs torchrun. ``smp-compat env`` walks steps 2 and 3.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from smp_compat.checkpoints.load_policy import TRUST_ENV, trust_value
from smp_compat.cli.launch_config import (
    SMP_V2, LaunchConfig, SMPLaunch, choose_launch_config, launch_environment, resolve_smp, with_script_major,
)  # fmt: skip
from smp_compat.cli.restarts import rendezvous_environment
from smp_compat.cli.run_args import NNODES_OPTIONS, NPROC_OPTIONS, local_world_size, node_count, option_value
from smp_compat.cli.run_args import parse_run_argv
from smp_compat.cli.run_job import (
    job_environment, local_job, print_job, process_counts, rewrite_notes, working_directory,
)  # fmt: skip
from smp_compat.cli.sm_env import TrainingJob, prepare_job_dirs
from smp_compat.errors import SMPConfigError
from smp_compat.globalstate import BIND_ENV
from smp_compat.host.cuda_on_cpu import CPU_CUDA_ENV
from smp_compat.host.heap import TUNE_MALLOC_ENV

__all__ = ["LaunchPlan", "note", "plan_launch", "run_command"]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything ``smp-compat run`` decided: the exact command, the variables it adds, and the layout."""

    command: list[str]
    env_updates: dict[str, str]
    smp: SMPLaunch
    nnodes: int | None
    nproc_per_node: int | None
    dry_run: bool
    job: TrainingJob | None = None
    notes: tuple[str, ...] = ()
    cwd: str | None = None

    @property
    def launch(self) -> LaunchConfig:
        """Where the config came from and what it says."""
        return self.smp.launch

    @property
    def world_size(self) -> int | None:
        """nnodes * nproc_per_node, or None when torchrun decides it at run time."""
        if self.nnodes is None or self.nproc_per_node is None:
            return None
        return self.nnodes * self.nproc_per_node


def plan_launch(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchPlan:
    """Parse ``smp-compat run`` arguments and decide the torchrun command and its environment (no side effects)."""
    env = os.environ if environ is None else environ
    # 1. The command line.
    args = parse_run_argv(argv)
    ns, estimator = args.ns, args.estimator
    # 2. The SMP config (--config, the estimator's distribution, an inherited SM_HP_MP_PARAMETERS); its major
    #    version (without any config: the script's imports) picks the part of the launch that checks it, exports
    #    it and shows its layout.
    launch = with_script_major(choose_launch_config(ns.config, estimator, env), args.script[0])
    smp = resolve_smp(launch)
    # 3. The SageMaker job.
    options, notes = process_counts(args.torchrun_options, estimator, launch, env)
    job = local_job(ns, options, estimator, env)
    notes += rewrite_notes(job)
    # 4. torchrun: the command and the variables every process gets.
    script, *script_args = args.script
    command = [sys.executable, "-m", "torch.distributed.run", *options, script, *job.script_args(), *script_args]
    env_updates = job_environment(job, estimator, env, launch_environment(smp, env))
    env_updates.update(_option_variables(ns, env))
    env_updates.update(rendezvous_environment(options))
    return LaunchPlan(
        command=command,
        env_updates=env_updates,
        smp=smp,
        nnodes=node_count(option_value(options, NNODES_OPTIONS, ns.nnodes)),
        nproc_per_node=local_world_size(option_value(options, NPROC_OPTIONS, ns.nproc_per_node)),
        dry_run=ns.dry_run,
        job=job,
        notes=tuple(notes),
        cwd=working_directory(job, estimator),
    )


def _option_variables(ns: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """What --bind-cores, --[no-]tune-malloc, --[no-]cpu-cuda and --trust-checkpoint export (applied in every
    process)."""
    out: dict[str, str] = {}
    if ns.bind_cores:
        out[BIND_ENV] = "1"
    if ns.tune_malloc is not None:
        out[TUNE_MALLOC_ENV] = "1" if ns.tune_malloc else "0"
    if ns.cpu_cuda is not None:
        out[CPU_CUDA_ENV] = "1" if ns.cpu_cuda else "0"
    if ns.trust_checkpoint:
        out[TRUST_ENV] = trust_value(ns.trust_checkpoint, env.get(TRUST_ENV))
    return out


def run_command(argv: list[str]) -> int:
    """``smp-compat run``: check, then exec torchrun (or, with --dry-run, show the plan and stop)."""
    plan = plan_launch(argv)
    for line in (*plan.launch.notes, *plan.notes):
        note(line)
    problem = None
    if plan.world_size is not None:
        problem = plan.smp.world_size_problem(plan.world_size, plan.nnodes, plan.nproc_per_node)
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


# ---------------------------------------------------------------- output


def note(text: str) -> None:
    """One line for the user on stderr, before the launch."""
    print(f"smp-compat: {text}", file=sys.stderr)


def _print_dry_run(plan: LaunchPlan) -> None:
    """The layout, the job, then the environment and command as plain lines, never wrapped (copy-paste)."""
    if plan.world_size is None:
        print(
            f"World size unknown before launch (--nnodes {plan.nnodes or 'range'}, --nproc-per-node "
            f"{plan.nproc_per_node or '?'}): no layout shown. Pass fixed numbers to see it."
        )
    else:
        plan.smp.print_layout(plan.world_size, plan.nnodes, plan.nproc_per_node)
    if plan.launch.parameters is None:
        init = "tsm.init" if plan.launch.major == SMP_V2 else "smp.init"
        print(f"No launch config: the script's {init}(...) dict decides (layout shown for the defaults).")
    if plan.job is not None:
        print_job(plan.job, plan.env_updates, plan.cwd)
    print("Environment added for every process:")
    for name, value in sorted(plan.env_updates.items()):
        print(f"  {name}={value}")
    print("Command:")
    print("  " + shlex.join(plan.command))
