"""What ``smp-compat run`` and ``smp-compat env`` add so that torch elastic's restarts (``--max-restarts``) work.

A restarted attempt must not meet the keys of the attempt that died. torch elastic shares its rendezvous
store with the workers' process group by default, and the store outlives the attempt: a restarted rank
can read a dead rank's address and fail in ``Gloo connectFullMesh ... Connection refused`` (NCCL: a hang
or a bad unique id). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes every c10d rendezvous round give the
workers a fresh store (pytorch/pytorch#135712, #167288); the static rendezvous, which ignores it, is
handled in ``smp.init`` (``launch.attempt_prefix``), which ``smp-compat run`` tells which rendezvous it
started. docs/design.md, "Restarts", has the measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from smp_compat.cli.run_args import option_value
from smp_compat.launch import SHARE_STORE_ENV, STATIC_RENDEZVOUS_ENV

__all__ = ["restart_environment", "rendezvous_environment"]


def restart_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, unless the user set the variable (their value is kept)."""
    if SHARE_STORE_ENV in environ:
        return {}
    return {SHARE_STORE_ENV: "1"}


def rendezvous_environment(torchrun_options: Sequence[str]) -> dict[str, str]:
    """Whether torchrun runs its static rendezvous (no ``--rdzv-backend`` or ``static``, no ``--standalone``):
    the workers cannot tell, and there a restarted attempt needs its prefix even where the user set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0`` (without it, two-node restarts hung: 0 of 6)."""
    backend = option_value(torchrun_options, ("--rdzv-backend", "--rdzv_backend"), "static")
    static = backend == "static" and "--standalone" not in torchrun_options
    return {STATIC_RENDEZVOUS_ENV: "1" if static else "0"}
