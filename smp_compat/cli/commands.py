"""The ``smp-compat`` entry point: pick the sub-command, run it, turn our errors into one line and exit 2."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from smp_compat.cli.check import check_command
from smp_compat.cli.checkpoint import checkpoint_command
from smp_compat.cli.env import env_command
from smp_compat.cli.plan import plan_command
from smp_compat.cli.run import run_command
from smp_compat.cli.timeline import timeline_command
from smp_compat.cli.selftest import selftest_command
from smp_compat.errors import SMPError

__all__ = ["COMMANDS", "Command", "main"]


Handler = Callable[[list[str]], int]


@dataclass(frozen=True)
class Command:
    """A sub-command: one line of help and the function that runs it with the remaining arguments."""

    help: str
    handler: Handler


COMMANDS: dict[str, Command] = {
    "run": Command("launch an SMP script under torchrun with the shim and config (--dry-run: show the layout)",
                   run_command),
    "env": Command("print export lines for launching by hand (srun, mpirun, python)", env_command),
    "check": Command("list the SMP APIs and config keys scripts use, with their support status",
                     check_command),
    "plan": Command("show the partition a model would get, in one process", plan_command),
    "timeline": Command("draw a recorded pipeline step per rank (terminal, SVG, HTML)",
                        timeline_command),
    "checkpoint": Command("inspect, merge or split SMP / smp_compat checkpoints (info, merge, split)",
                          checkpoint_command),
    "selftest": Command("check that smp_compat trains correctly on this machine or cluster (run it first)",
                        selftest_command),
}  # fmt: skip
"""Sub-commands by name, each in its own module of this package."""


def _usage() -> str:
    lines = ["usage: smp-compat COMMAND [options]", "", "commands:"]
    width = max(len(name) for name in COMMANDS)
    lines += [f"  {name:<{width}} {command.help}" for name, command in COMMANDS.items()]
    lines += ["", "`smp-compat COMMAND --help` describes each command."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``smp-compat`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        from smp_compat.cli.versions import version_command

        return version_command()
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"smp-compat: unknown command {args[0]!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return command.handler(args[1:])
    except SMPError as exc:
        print(f"smp-compat {args[0]}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `smp-compat checkpoint info ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0


if __name__ == "__main__":
    sys.exit(main())
