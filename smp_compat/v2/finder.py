"""The import hook that makes ``torch.sagemaker[.<x>]`` the modules ``smp_compat.v2[.<x>]``, and the GPU-only
packages SMP v2 scripts import (Transformer Engine, megatron-core's checkpoint exception, SMDDP) our stand-ins.

``torch.sagemaker`` is a submodule of torch, so no package on ``PYTHONPATH`` can provide it: a
``sys.meta_path`` finder must. It is *appended*, and for a top-level alias it first asks every other finder:
a real SMP build (whose torch ships ``sagemaker``), a real Transformer Engine or SMDDP always wins. Once it
has served an alias there is no real one, and the finder moves to the front, so that ``torch.sagemaker.x``
maps to the already imported ``smp_compat.v2.x`` instead of being loaded a second time from
``smp_compat.v2``'s folder.

Standard library only: the launcher's ``sitecustomize`` loads this file by path at interpreter start,
before torch or smp_compat are imported, and installing costs nothing until a script imports a name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = [
    "ALIAS", "ALIASES", "TARGET", "TorchSagemakerFinder", "install_finder", "missing_smp_compat", "remove_finder",
    "target_name",
]  # fmt: skip

ALIAS = "torch.sagemaker"
"""The SMP v2 import name scripts use (``import torch.sagemaker as tsm``)."""

TARGET = "smp_compat.v2"
"""The package it stands for."""

_STANDINS = "smp_compat.v2.standins"

ALIASES: dict[str, str] = {
    ALIAS: TARGET,
    "transformer_engine": f"{_STANDINS}.transformer_engine",
    "megatron": f"{_STANDINS}.megatron",
    "smdistributed": f"{_STANDINS}.smdistributed",
    "smdistributed.dataparallel": f"{_STANDINS}.smdistributed.dataparallel",
}
"""Alias -> our package, for names no installed package provides (the longest matching alias applies)."""

_MARK = "_smp_compat_v2_alias_finder"
"""Set on every instance, so copies loaded under another module name (the sitecustomize's) are recognised."""


def _alias_of(fullname: str) -> str | None:
    """The longest alias that ``fullname`` is or lies under."""
    found = [a for a in ALIASES if fullname == a or fullname.startswith(a + ".")]
    return max(found, key=len) if found else None


def target_name(fullname: str) -> str | None:
    """``torch.sagemaker.x.y`` -> ``smp_compat.v2.x.y`` (and so on for each alias); None for any other name."""
    alias = _alias_of(fullname)
    return None if alias is None else ALIASES[alias] + fullname[len(alias) :]


def _serving(alias: str) -> bool:
    """True when ``alias`` in this process is our module (not a real install)."""
    module = sys.modules.get(alias)
    return module is not None and getattr(module, "__name__", None) == ALIASES[alias]


def _found_elsewhere(finder: object, fullname: str, path: Sequence[str] | None) -> bool:
    """Whether another finder on ``sys.meta_path`` provides ``fullname`` (a real install wins)."""
    for other in list(sys.meta_path):
        if other is finder or getattr(other, _MARK, False) or not hasattr(other, "find_spec"):
            continue
        if other.find_spec(fullname, path) is not None:
            return True
    return False


def missing_smp_compat(name: str) -> str:
    """Why ``name`` cannot resolve in a Python that cannot import smp_compat, and what to do (one message)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return (
        f"{name} is provided by smp_compat, which this Python cannot import: {sys.executable}. smp_compat's "
        f"sitecustomize is on PYTHONPATH, but the package ({package}) is installed for another Python: the "
        "launcher (torchrun, srun, mpirun, a job script) started a different interpreter from the one `smp-compat` "
        "runs in. Start the job with that Python (its `python -m torch.distributed.run ...`, or its bin folder "
        f"first on PATH), or install smp_compat for this one: {sys.executable} -m pip install smp-compat."
    )


def _check_importable(fullname: str, real: str) -> None:
    """Raise ``missing_smp_compat``'s message instead of "No module named 'smp_compat'" from inside this file."""
    top = real.partition(".")[0]
    if top not in sys.modules and importlib.util.find_spec(top) is None:
        raise ModuleNotFoundError(missing_smp_compat(fullname), name=fullname)


class _AliasLoader(importlib.abc.Loader):
    """Imports the real module and puts it under the alias name (one module object, one copy of the state)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a throwaway module; exec_module swaps it out

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)
        if module.__name__ in ALIASES:
            _move_to_front()


class TorchSagemakerFinder(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that answers for an alias nobody else provides and, once it is ours, its submodules."""

    def __init__(self) -> None:
        setattr(self, _MARK, True)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        alias = _alias_of(fullname)
        if alias is None:
            return None
        parent = alias.rpartition(".")[0]
        ours_above = parent in ALIASES and _serving(parent)  # smdistributed.dataparallel under our smdistributed
        if fullname == alias and not ours_above and _found_elsewhere(self, fullname, path):
            return None  # a real install wins
        if fullname != alias and not _serving(alias):
            return None  # a real package's missing submodule stays missing
        real = ALIASES[alias] + fullname[len(alias) :]
        _check_importable(fullname, real)
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None  # ModuleNotFoundError then names the module the script asked for
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
