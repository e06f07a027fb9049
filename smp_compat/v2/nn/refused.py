"""A module class that imports but cannot be built: SMP names the scripts import without using them."""

from __future__ import annotations

from typing import Any

from torch import nn

from smp_compat.errors import SMPUnsupportedError

__all__ = ["RefusedModule"]


class RefusedModule(nn.Module):
    """Subclasses set ``_why`` (what to do instead); building one raises SMPUnsupportedError naming the class."""

    _why = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = f"{type(self).__module__.replace('smp_compat.v2', 'torch.sagemaker')}.{type(self).__qualname__}"
        raise SMPUnsupportedError(f"{name} is not supported by smp_compat: {self._why}")
