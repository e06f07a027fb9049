"""The import hook that lets smp_compat fix Hugging Face's Trainer as transformers' own modules finish loading.

Standard library only: ``smp-compat run``'s ``sitecustomize`` loads this file by path at the start of every
worker (before the script imports anything), and ``import smp_compat`` installs it too. It answers only for
``transformers.training_args`` and ``transformers.trainer``; after such a module has run, it hands it to
``smp_compat.trainer.fixes.patch_module``, and only in an SMP job (the test transformers' own
``is_sagemaker_mp_enabled()`` makes on the environment), so a job without SMP imports transformers untouched.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["TARGETS", "TransformersHook", "install_hook", "is_smp_job", "patch_now"]

TARGETS = ("transformers.training_args", "transformers.trainer")
"""The transformers modules whose SMP code paths smp_compat corrects (``smp_compat/trainer/fixes.py``)."""

_MARK = "_smp_compat_trainer_hook"


def is_smp_job(environ: Any = None) -> bool:
    """transformers' ``is_sagemaker_mp_enabled()`` test on the environment: ``"partitions"`` in
    ``SM_HP_MP_PARAMETERS`` and ``sagemaker_mpi_enabled`` in ``SM_FRAMEWORK_PARAMS`` (``smp-compat run`` sets both)."""
    env = os.environ if environ is None else environ
    try:
        params = json.loads(env.get("SM_HP_MP_PARAMETERS", "{}"))
        framework = json.loads(env.get("SM_FRAMEWORK_PARAMS", "{}"))
    except json.JSONDecodeError:
        return False
    return isinstance(params, dict) and "partitions" in params and isinstance(framework, dict) and bool(
        framework.get("sagemaker_mpi_enabled", False)
    )


def patch_now(module: ModuleType) -> None:
    """Fix ``module`` (one of ``TARGETS``) when this process is an SMP job; nothing otherwise."""
    if is_smp_job():
        importlib.import_module("smp_compat.trainer.fixes").patch_module(module)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then ``after(module)``; anything else is the original loader's."""

    def __init__(self, loader: Any, after: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, name)


class TransformersHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` entry that finds ``TARGETS`` through the other finders and wraps their loader."""

    def __init__(self) -> None:
        setattr(self, _MARK, True)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if getattr(finder, _MARK, False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch_now)
                return spec
        return None


def install_hook() -> None:
    """Put the hook first on ``sys.meta_path`` once (a copy loaded by path counts: it carries the mark)."""
    if not any(getattr(f, _MARK, False) for f in sys.meta_path):
        sys.meta_path.insert(0, TransformersHook())
