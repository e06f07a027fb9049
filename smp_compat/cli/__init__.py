"""The ``smp-compat`` command: one module per sub-command (run, env, check, plan, timeline, checkpoint; selftest
lives in its own package, ``smp_compat.selftest``).

The top layer: modules here may import anything in smp_compat, and nothing in smp_compat imports them but
``smp_compat.selftest``, the other top layer (its command launches itself through ``run``).
``support.py`` (the registry of what is supported, behind ``check`` and docs/api_support.md) lives here too.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``smp-compat`` console script; returns the exit status.

    Imported on call, so ``python -m smp_compat.cli.support`` does not load every sub-command first.
    """
    from smp_compat.cli.commands import main as run_main

    return run_main(argv)
