"""``torch.sagemaker.utils.module_utils``: ``empty_module_params`` and ``move_buffers_to_device``, named in SMP's
reference without a documented signature (unused by AWS's scripts): the semantics here are the names' plain
meaning, documented in docs/api_support.md as partial."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["empty_module_params", "move_buffers_to_device"]


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def empty_module_params(module: nn.Module, device: torch.device | str | None = None, recurse: bool = True) -> nn.Module:
    """Give ``module``'s parameters and buffers uninitialised storage on ``device`` (default: this rank's device),
    e.g. to materialise a model built on the meta device before loading or initialising it."""
    return module.to_empty(device=device or _default_device(), recurse=recurse)


def move_buffers_to_device(module: nn.Module, device: torch.device | str | None = None, recurse: bool = True) -> nn.Module:
    """Move only ``module``'s buffers (not its parameters) to ``device``, keeping each buffer's persistence."""
    target = device or _default_device()
    modules = module.modules() if recurse else [module]
    for owner in modules:
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if buffer is not None:
                owner._buffers[name] = buffer.to(target)
    return module
