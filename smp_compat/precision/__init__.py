"""Mixed precision: ``smp.amp.GradScaler`` (``grad_scaler.py``), SMP's fp16/bf16 optimizer (``fp16.py``) and
16-bit module (``module16.py``).

Both agree on skip-or-step over the pipeline so every stage does the same. May import the core only.
``smp_compat.amp`` is SMP's public path for the scaler.
"""

from __future__ import annotations

__all__: list[str] = []
