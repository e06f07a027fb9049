"""Stand-ins for the GPU-only packages SMP v2 scripts import: used only where the real package is absent.

``transformer_engine``, ``megatron`` (its checkpoint exception) and ``smdistributed`` (SMDDP's backend) are
served by smp_compat.v2.finder under their own names when no installed package provides them; the SMDDP
and NCCL backend names map to what this machine can run (``backend.py``); ``flash_attention_2`` falls back
to ``sdpa`` without flash-attn (``attention.py``). Each announces itself once per process (:func:`announce`).
"""

from __future__ import annotations

import logging

__all__ = ["announce"]

log = logging.getLogger("smp_compat.v2.standins")

_announced: set[str] = set()


def announce(key: str, message: str) -> None:
    """Log ``message`` once per process and ``key`` (a warning: the job runs differently than on SageMaker)."""
    if key not in _announced:
        _announced.add(key)
        log.warning("smp_compat: %s", message)
