"""The import hook that makes ``smdistributed.modelparallel.torch[.<x>]`` the same modules as ``smp_compat[.<x>]``."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["ALIAS", "TARGET", "AliasFinder", "install_finder", "remove_finder", "target_name"]

ALIAS = "smdistributed.modelparallel.torch"
"""The SMP v1 import name that scripts use."""

TARGET = "smp_compat"
"""The package it stands for."""


def target_name(fullname: str) -> str | None:
    """``smdistributed.modelparallel.torch.x.y`` -> ``smp_compat.x.y``; None for any other name."""
    if fullname == ALIAS:
        return TARGET
    if fullname.startswith(ALIAS + "."):
        return TARGET + fullname[len(ALIAS) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Imports the real module and puts it under the alias name.

    The import system returns whatever ``sys.modules`` holds for the name after ``exec_module``, so the
    alias and the real name share one module object (one copy of smp_compat's state), and the real
    module's ``__spec__`` and ``__name__`` stay untouched.
    """

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a throwaway module; exec_module swaps it out

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class AliasFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that answers only for the SMP alias names."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = target_name(fullname)
        if real is None:
            return None
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None  # ModuleNotFoundError then names the SMP module the script asked for
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def _installed() -> AliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, AliasFinder)), None)


def install_finder() -> None:
    """Put the finder first on ``sys.meta_path`` (once), ahead of the path-based finders."""
    if _installed() is None:
        sys.meta_path.insert(0, AliasFinder())


def remove_finder() -> None:
    """Take the finder off ``sys.meta_path`` (aliases already imported stay in ``sys.modules``)."""
    finder = _installed()
    if finder is not None:
        sys.meta_path.remove(finder)
