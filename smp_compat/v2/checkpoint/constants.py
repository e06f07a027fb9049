"""``torch.sagemaker.checkpoint.constants``: the markers SMP puts in partial (per-rank) state dicts.

SMP v1 marks a local state dict with ``"_smp_is_partial": True`` and its layout under ``"_smp_load_info"``
(docs/checkpoints.md; smp_compat's v1 checkpoints use the same keys). HyperPod's training adapter imports the two
names to drop them from a state dict before loading it into a plain model.
"""

from __future__ import annotations

__all__ = ["SMP_IS_LOAD_INFO_KEY", "SMP_IS_PARTIAL_KEY"]

SMP_IS_PARTIAL_KEY = "_smp_is_partial"
SMP_IS_LOAD_INFO_KEY = "_smp_load_info"
