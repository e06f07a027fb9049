"""SMP's public ``smp.amp`` path (``smdistributed.modelparallel.torch.amp``); the scaler lives in
``smp_compat.precision.grad_scaler``."""

from __future__ import annotations

from smp_compat.precision.grad_scaler import GradScaler

__all__ = ["GradScaler"]
