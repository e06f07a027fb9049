"""``smp-compat env``: print export lines for launching an SMP script by hand (srun, mpirun, plain python)."""

from __future__ import annotations

import argparse
import os
import shlex

from smp_compat.cli.run import launch_environment, note, read_launch_config, resolve_launch

__all__ = ["env_command"]


def env_command(argv: list[str]) -> int:
    """``smp-compat env``: print ``export`` lines for launching by hand (srun, mpirun) with the shim and config."""
    parser = argparse.ArgumentParser(
        prog="smp-compat env",
        description="Print shell export lines that make an unmodified SMP script run under srun, mpirun or "
        'plain python: eval "$(smp-compat env --config dp2.json)"',
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="JSON_OR_FILE", help="as for `smp-compat run --config`")
    ns = parser.parse_args(argv)
    launch = read_launch_config(ns.config, os.environ)
    env = launch_environment(launch, resolve_launch(launch), os.environ)
    for line in launch.notes:
        note(line)
    for name, value in sorted(env.items()):
        print(f"export {name}={shlex.quote(value)}")
    return 0
