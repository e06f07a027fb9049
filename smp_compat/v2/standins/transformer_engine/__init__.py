"""smp_compat's stand-in for NVIDIA Transformer Engine, served as ``transformer_engine`` only where it is not
installed (a CPU, or a GPU host without it): what AWS's SMP v2 scripts use of it, in torch's terms.

``pytorch.fp8_autocast`` runs the block in the model's own precision (fp8 needs TE on an sm_89+ GPU),
``common.recipe`` has the recipe classes, ``pytorch.checkpoint`` is torch's activation checkpoint and
``pytorch.attention.MultiheadAttention`` exists for ``isinstance`` checks.
"""

from __future__ import annotations

from smp_compat.v2.standins import absent_names, announce
from smp_compat.v2.standins.transformer_engine import common, pytorch

__all__ = ["common", "pytorch"]

__version__ = "0.0.0+smp_compat.standin"

announce("transformer_engine", "transformer_engine is not installed: using smp_compat's stand-in (no fp8, torch's "
         "activation checkpointing).")  # fmt: skip

__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
