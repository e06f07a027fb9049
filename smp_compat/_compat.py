"""The few private torch APIs smp_compat relies on, in one place, so a torch upgrade breaks one file."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["default_store"]


def default_store() -> Any:
    """The key-value store of the default process group (used to broadcast a failure to every rank)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
