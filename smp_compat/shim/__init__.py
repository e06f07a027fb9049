"""How ``import smdistributed.modelparallel.torch`` resolves to smp_compat, for unmodified SMP scripts.

``site/`` holds a tiny ``smdistributed`` package. It is never on ``sys.path`` after ``pip install`` (so a
real SMP install wins wherever it exists); ``smp-compat run`` puts it on the launched processes'
``PYTHONPATH``, and :func:`install` puts it on this process's ``sys.path``. Importing
``smdistributed.modelparallel.torch`` then installs :class:`~smp_compat.shim.finder.AliasFinder`, which
maps that name and every submodule to the already imported ``smp_compat`` modules: one copy of the state.
"""

from __future__ import annotations

import importlib
import os
import sys

from smp_compat.errors import SMPError
from smp_compat.shim.finder import ALIAS, TARGET, install_finder, remove_finder

__all__ = ["SITE_DIR", "SMP_API_VERSION", "ShimConflictError", "install", "pythonpath_with_shim", "uninstall"]

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
"""The directory to put on PYTHONPATH so that ``smdistributed`` is importable."""

SMP_API_VERSION = "1.15.0"
"""``smdistributed.modelparallel.__version__``: the SMP v1 release whose API smp_compat follows.

Hugging Face's Trainer reads it (features gated on >= 1.10); smp_compat's own version is ``smp_compat.__version__``.
"""


class ShimConflictError(SMPError, ImportError):
    """The real SMP library is already imported in this process, so the alias cannot be installed."""


def _check_no_real_smp() -> None:
    """Two libraries behind one name would split the state; refuse instead."""
    existing = sys.modules.get(ALIAS)
    if existing is not None and existing is not sys.modules[TARGET]:
        origin = getattr(existing, "__file__", None) or repr(existing)
        raise ShimConflictError(
            f"{ALIAS} is already imported in this process from {origin}, which is not smp_compat (the real "
            "SMP library?). Call smp_compat.shim.install() before anything imports smdistributed, or use "
            "`import smp_compat as smp` in this process."
        )


def install() -> None:
    """Make ``import smdistributed.modelparallel.torch`` give smp_compat in this process (notebooks, tests).

    Safe to call twice. Submodules map too: ``smdistributed.modelparallel.torch.stepping.step`` is ``smp_compat.stepping.step``.
    """
    _check_no_real_smp()
    _drop_v2_standin()
    install_finder()
    if SITE_DIR not in sys.path:
        sys.path.insert(0, SITE_DIR)
    importlib.invalidate_caches()


def _drop_v2_standin() -> None:
    """``smdistributed`` imported earlier in this process as SMP v2's stand-in (smp_compat.v2's finder serves it
    for SMDDP's ``smdistributed.dataparallel`` where no ``smdistributed`` exists; it has no ``modelparallel``)
    gives way to the shim's package; its ``dataparallel`` is served again under the shim's."""
    for name in [n for n in sys.modules if n == "smdistributed" or n.startswith("smdistributed.")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET + ".v2."):
            del sys.modules[name]


def uninstall() -> None:
    """Undo :func:`install`: drop the finder, the path entry and the shim's ``smdistributed`` modules."""
    remove_finder()
    while SITE_DIR in sys.path:
        sys.path.remove(SITE_DIR)
    for name in [n for n in sys.modules if n == "smdistributed" or n.startswith("smdistributed.")]:
        module = sys.modules[name]
        if _is_shim_module(module):
            del sys.modules[name]
    importlib.invalidate_caches()


def _is_shim_module(module: object) -> bool:
    """Modules that came from the shim: smp_compat's own, or the stand-in packages under ``SITE_DIR``."""
    name = getattr(module, "__name__", "")
    if name == TARGET or name.startswith(TARGET + "."):
        return True
    path = getattr(module, "__file__", None) or ""
    return os.path.abspath(path).startswith(SITE_DIR + os.sep)


def pythonpath_with_shim(current: str | None) -> str:
    """``current`` PYTHONPATH with the shim directory in front (once)."""
    parts = [p for p in (current or "").split(os.pathsep) if p and p != SITE_DIR]
    return os.pathsep.join([SITE_DIR, *parts])
