"""``torch.sagemaker.state_handler``: where SMP defines ``state``; the same object as ``tsm.state``."""

from __future__ import annotations

from smp_compat.v2.state import state

__all__ = ["state"]
