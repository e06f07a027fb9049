"""``torch.sagemaker.utils.process_group_utils.get_global_ranks``: a group's members as global ranks."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["get_global_ranks"]


def get_global_ranks(process_group: Any = None) -> list[int]:
    """The global ranks in ``process_group`` (the world when None), in group-rank order."""
    return list(dist.get_process_group_ranks(process_group or dist.group.WORLD))
