"""The import hook that makes ``torch.sagemaker[.<x>]`` the modules ``smp_compat.v2[.<x>]``.

``torch.sagemaker`` is a submodule of torch, so no package on ``PYTHONPATH`` can provide it: a
``sys.meta_path`` finder must. It is *appended*, so a real SMP build (whose torch ships ``sagemaker``) wins:
the path finder before it finds that first. Once it has served ``torch.sagemaker`` there is no real one,
and the finder moves to the front, so that ``torch.sagemaker.x`` maps to the already imported
``smp_compat.v2.x`` instead of being loaded a second time from ``smp_compat.v2``'s folder.

Standard library only: the launcher's ``sitecustomize`` loads this file by path at interpreter start,
before torch or smp_compat are imported, and installing costs nothing until a script imports the name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["ALIAS", "TARGET", "TorchSagemakerFinder", "install_finder", "remove_finder", "target_name"]

ALIAS = "torch.sagemaker"
"""The SMP v2 import name scripts use (``import torch.sagemaker as tsm``)."""

TARGET = "smp_compat.v2"
"""The package it stands for."""

_MARK = "_smp_compat_v2_alias_finder"
"""Set on every instance, so copies loaded under another module name (the sitecustomize's) are recognised."""


def target_name(fullname: str) -> str | None:
    """``torch.sagemaker.x.y`` -> ``smp_compat.v2.x.y``; None for any other name."""
    if fullname == ALIAS:
        return TARGET
    if fullname.startswith(ALIAS + "."):
        return TARGET + fullname[len(ALIAS) :]
    return None


def _serving() -> bool:
    """True when ``torch.sagemaker`` in this process is smp_compat's (not a real SMP install)."""
    module = sys.modules.get(ALIAS)
    return module is not None and getattr(module, "__name__", None) == TARGET


class _AliasLoader(importlib.abc.Loader):
    """Imports the real module and puts it under the alias name (one module object, one copy of the state)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a throwaway module; exec_module swaps it out

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)
        if module.__name__ == ALIAS:
            _move_to_front()


class TorchSagemakerFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that answers only for ``torch.sagemaker`` and, once that is ours, its submodules."""

    def __init__(self) -> None:
        setattr(self, _MARK, True)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = target_name(fullname)
        if real is None or (fullname != ALIAS and not _serving()):
            return None  # a real torch.sagemaker's missing submodule stays missing
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None  # ModuleNotFoundError then names the torch.sagemaker module the script asked for
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def _installed() -> importlib.abc.MetaPathFinder | None:
    return next((f for f in sys.meta_path if getattr(f, _MARK, False)), None)  # type: ignore[misc]


def install_finder() -> None:
    """Append the finder to ``sys.meta_path`` (once); a real ``torch.sagemaker`` is found before it."""
    if _installed() is None:
        sys.meta_path.append(TorchSagemakerFinder())


def _move_to_front() -> None:
    finder = _installed()
    if finder is not None and sys.meta_path[0] is not finder:
        sys.meta_path.remove(finder)
        sys.meta_path.insert(0, finder)


def remove_finder() -> None:
    """Take the finder off ``sys.meta_path`` (modules already imported stay in ``sys.modules``)."""
    finder = _installed()
    while finder is not None:
        sys.meta_path.remove(finder)
        finder = _installed()
