"""What ``smp-compat run`` and ``smp-compat env`` add so that torch elastic's restarts (``--max-restarts``) work.

A restarted attempt must not meet the keys of the attempt that died. torch elastic shares its rendezvous
store with the workers' process group by default, and the store outlives the attempt: a restarted rank
can read a dead rank's address and fail in ``Gloo connectFullMesh ... Connection refused`` (NCCL: a hang
or a bad unique id). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` makes every c10d rendezvous round give the
workers a fresh store (pytorch/pytorch#135712, #167288); the static rendezvous, which ignores it, is
handled in ``smp.init`` (``launch.attempt_prefix``). docs/design.md, "Restarts", has the measurements.
"""

from __future__ import annotations

from collections.abc import Mapping

from smp_compat.launch import SHARE_STORE_ENV

__all__ = ["restart_environment"]


def restart_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, unless the user set the variable (their value is kept)."""
    if SHARE_STORE_ENV in environ:
        return {}
    return {SHARE_STORE_ENV: "1"}
