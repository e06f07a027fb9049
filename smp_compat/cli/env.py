"""``smp-compat env``: print export lines for launching an SMP script by hand (srun, mpirun, plain python)."""

from __future__ import annotations

import argparse
import os
import shlex

from smp_compat.cli.job_options import add_job_options, build_job
from smp_compat.cli.launch_config import launch_environment, read_launch_config, resolve_smp
from smp_compat.cli.run import note
from smp_compat.cli.run_job import num_gpus
from smp_compat.cli.sm_env import node_position, prepare_job_dirs, training_environment

__all__ = ["env_command"]


def env_command(argv: list[str]) -> int:
    """``smp-compat env``: print ``export`` lines for launching by hand (srun, mpirun) with the shim and config.

    The SageMaker variables name this node by the Slurm step's or Open MPI's node rank, so on several
    nodes evaluate the lines on each node (inside srun / mpirun's command); the job folders are created now.
    """
    parser = argparse.ArgumentParser(
        prog="smp-compat env",
        description="Print shell export lines that make an unmodified SMP script run under srun, mpirun or "
        'plain python: eval "$(smp-compat env --config dp2.json)"',
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="JSON_OR_FILE", help="as for `smp-compat run --config`")
    add_job_options(parser)
    ns = parser.parse_args(argv)
    launch = read_launch_config(ns.config, os.environ)
    env = launch_environment(resolve_smp(launch), os.environ)
    nnodes, node_rank = node_position(os.environ, None, None)
    job = build_job(ns, os.environ, nnodes=nnodes, node_rank=node_rank, num_gpus=num_gpus(), entry_point=None)
    env.update(training_environment(job, os.environ))
    for line in launch.notes:
        note(line)
    prepare_job_dirs(job, {**os.environ, **env})
    for name, value in sorted(env.items()):
        print(f"export {name}={shlex.quote(value)}")
    if job.script_args():
        args = shlex.join(job.script_args())
        print(f"# the hyperparameters as script arguments (append them to the command): {args}")
    return 0
