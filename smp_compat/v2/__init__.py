"""SMP v2 (``torch.sagemaker``) on stock PyTorch: ``import smp_compat.v2 as tsm``, or ``import torch.sagemaker as tsm``
in a process ``smp-compat run`` started (or after this package's import installed the finder).

The folder mirrors ``torch.sagemaker``'s public module paths (``torch.sagemaker.x`` is ``smp_compat.v2.x``).
v2 code may import the shared core (errors, config sources, launch, failure, checkpoints' signing) but never
SMP v1's features (runtime, stepping, sdp, nn, ...), and they never import it (tests/core/test_layout.py).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from smp_compat.v2.finder import install_finder
from smp_compat.v2.standins.backend import install_backend_mapping
from smp_compat.v2.startup import init, is_initialized
from smp_compat.v2.state import state

__all__ = ["init", "is_initialized", "state", "transform"]


def _transform_function() -> Any:
    from smp_compat.v2.transform import transform as implementation  # heavy (transformers): on first use

    return implementation


class _Pinned:
    """A package attribute that a same-named submodule cannot replace.

    SMP's ``tsm.state`` is an object and ``tsm.transform`` a function, while our modules ``state.py`` and
    ``transform/`` share those names; importing such a submodule (``import torch.sagemaker.state``) makes
    the import system bind it on the package, which this descriptor ignores.
    """

    def __init__(self, get: Any) -> None:
        self._get = get

    def __get__(self, module: Any, owner: Any = None) -> Any:
        return self._get()

    def __set__(self, module: Any, value: Any) -> None:
        pass  # the import system binding the submodule: the SMP object stays the attribute


class _Package(types.ModuleType):
    """The package's module type, which pins ``state`` and ``transform``."""

    state = _Pinned(lambda: _state)
    transform = _Pinned(_transform_function)


_state = state
del state  # served by _Package.state from here on
sys.modules[__name__].__class__ = _Package
install_finder()
install_backend_mapping()  # before the script's dist.init_process_group("smddp" | "nccl"), which precedes tsm.init
