"""Stand-ins for the GPU-only packages SMP v2 scripts import: used only where the real package is absent.

``transformer_engine``, ``megatron`` (its checkpoint exception) and ``smdistributed`` (SMDDP's backend) are
served by smp_compat.v2.finder under their own names when no installed package provides them; the SMDDP
and NCCL backend names map to what this machine can run (``backend.py``); ``flash_attention_2`` falls back
to ``sdpa`` without flash-attn (``attention.py``). Each announces itself once per process (:func:`announce`).

Every name a stand-in module lacks raises :class:`~smp_compat.errors.StandinMissingError`, an ImportError, on
attribute access as on ``from ... import`` (:func:`absent_names`): libraries guard their optional use of these
packages with ``except ImportError``, and a stand-in must take them down that branch as absence would.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from smp_compat.errors import StandinMissingError

__all__ = ["absent_names", "announce"]

log = logging.getLogger("smp_compat.v2.standins")

_announced: set[str] = set()


def announce(key: str, message: str) -> None:
    """Log ``message`` once per process and ``key`` (a warning: the job runs differently than on SageMaker)."""
    if key not in _announced:
        _announced.add(key)
        log.warning("smp_compat: %s", message)


def _public_name(module_name: str) -> str:
    """``smp_compat.v2.standins.transformer_engine.pytorch`` -> ``transformer_engine.pytorch`` (the name served)."""
    from smp_compat.v2.finder import ALIASES

    for alias, target in sorted(ALIASES.items(), key=lambda item: -len(item[1])):
        if module_name == target or module_name.startswith(target + "."):
            return alias + module_name[len(target) :]
    return module_name


def absent_names(module_name: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the stand-in ``module_name``: its submodules load on first use, every other
    name raises StandinMissingError (an ImportError); dunder names raise AttributeError, as Python's own
    probes (``getattr(m, "__path__", None)``, ``inspect``, ``pickle``) expect of any module."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        package = importlib.import_module(module_name)
        if hasattr(package, "__path__") and importlib.util.find_spec(f"{module_name}.{name}") is not None:
            return importlib.import_module(f"{module_name}.{name}")
        public = _public_name(module_name)
        raise StandinMissingError(
            f"cannot import name {name!r} from {public!r}: {public.split('.')[0]} is not installed, and "
            f"smp_compat's stand-in for it does not provide {name!r} (install the real package for it)",
            name=public,
        )

    return __getattr__
