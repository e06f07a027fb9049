"""The oldest torch smp_compat runs on, checked once at ``import smp_compat``.

Below it, a missing API would surface as an ImportError or AttributeError deep inside a step; here it is one
SMPUnsupportedError naming the features and the version they need. This floor is where those APIs exist;
pyproject.toml asks for the oldest torch the whole suite passed on (higher: docs/versions.md has the runs).
"""

from __future__ import annotations

import torch

from smp_compat.errors import SMPUnsupportedError

__all__ = ["TORCH_FLOOR", "check_torch"]

TORCH_FLOOR = "2.8"


def _missing() -> list[str]:
    """The APIs this torch lacks, each with the feature that needs it and the release that made it usable."""
    missing = []
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        missing.append("sharded data parallelism: FSDP2 (torch.distributed.fsdp.fully_shard, public from 2.6) "
                       "and DTensor (torch.distributed.tensor, 2.5)")  # fmt: skip
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        missing.append("pipeline parallelism: carrying the step's saved-tensor hooks (activation checkpointing, "
                       "save_on_cpu) to the pipeline threads (torch._C._autograd._top_saved_tensors_default_hooks, "
                       "from 2.8)")  # fmt: skip
    return missing


def check_torch() -> None:
    """SMPUnsupportedError when this torch lacks an API smp_compat needs."""
    missing = _missing()
    if missing:
        raise SMPUnsupportedError(
            f"smp_compat needs torch >= {TORCH_FLOOR}; this is torch {torch.__version__}, which lacks what "
            f"{'; '.join(missing)} need. pip install 'torch>={TORCH_FLOOR}'")  # fmt: skip
