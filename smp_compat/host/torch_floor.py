"""The oldest torch smp_compat runs on, checked once at ``import smp_compat``.

Below it, a missing API would surface as an ImportError or AttributeError deep inside a step; here it is one
SMPUnsupportedError naming the features and the version they need. This floor is where those APIs exist;
pyproject.toml asks for the oldest torch the whole suite passed on (higher: docs/versions.md has the runs).
"""

from __future__ import annotations

import torch

from smp_compat.errors import SMPUnsupportedError

__all__ = ["SHARDING_FLOOR", "TORCH_FLOOR", "check_sharding", "check_torch"]

TORCH_FLOOR = "2.8"
SHARDING_FLOOR = "2.9"
"""FSDP2 exists under 2.8 but does not equal plain PyTorch there (tests/sdp, docs/versions.md): refused, not run."""


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


def check_sharding(feature: str) -> None:
    """SMPUnsupportedError where this torch's FSDP2 trains measurably wrong (2.8): before any ``fully_shard``."""
    if torch.torch_version.TorchVersion(torch.__version__) < SHARDING_FLOOR:
        raise SMPUnsupportedError(
            f"{feature} needs torch >= {SHARDING_FLOOR}: under torch {torch.__version__}, FSDP2 (fully_shard) "
            f"does not train equal to plain PyTorch (docs/versions.md). pip install 'torch>={SHARDING_FLOOR}'"
        )
