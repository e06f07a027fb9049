"""``smp-compat selftest``: prove smp_compat computes the right thing on this cluster, in one command.

The command launches this package (``python -m smp_compat.selftest``) like ``smp-compat run`` launches a
script: under torchrun, with the shim and the config; under Slurm or MPI, ``smp-compat env`` and then
``python -m smp_compat.selftest``. Every rank reports its environment, runs a battery of small trainings
(data, pipeline, tensor and sharded data parallelism, 16-bit, activation checkpointing, checkpoints, and
the user's own config), each against the same training in one process, and rank 0 prints the report.

The layer just below ``smp_compat.cli``: only ``smp_compat.cli.selftest`` (the command, which launches this
package through ``smp-compat run``'s launcher) imports it. One concern per module: ``worker`` (a rank's main), ``environment`` (the
environment report), ``checks`` (the battery), ``models`` and ``training`` (what a check trains and how it
compares), ``runner`` (running checks without one rank's failure hanging the others), ``report`` (table and
JSON), ``faults`` (fault injection, for testing the selftest itself).
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """A rank's entry point (``python -m smp_compat.selftest``); returns the exit status."""
    from smp_compat.selftest.worker import main as worker_main

    return worker_main(argv)
