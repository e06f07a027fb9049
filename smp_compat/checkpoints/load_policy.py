"""What a checkpoint file may hold when it loads: harmless types always, anything from a trusted folder.

Loading is safe by default (``torch.load(weights_only=True)``), which refuses every class it does not
know. Scripts routinely keep their argparse arguments, numpy scalars, a numpy RNG state or their
Hugging Face config in ``user_content``; those types only hold data, so they are allow-listed here
(``DATA_ONLY``, and ``hf_configs`` for configs). Anything else (a function, a script's own class) loads
from a job's own signed files (``signing``) or from files the user trusts, which the user says
without editing the script: ``SMP_COMPAT_TRUST_CHECKPOINTS`` (``1`` for every file, or folders
separated by ``os.pathsep``), set by ``smp-compat run --trust-checkpoint DIR``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import os
import pathlib
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.serialization import get_safe_globals, safe_globals

from smp_compat.checkpoints.hf_configs import config_classes

__all__ = [
    "DATA_ONLY", "TRUST_ENV", "TRUST_FLAG", "harmless_globals", "is_trusted", "allow_harmless", "refusal_message",
    "trust_value",
]  # fmt: skip

TRUST_ENV = "SMP_COMPAT_TRUST_CHECKPOINTS"
TRUST_FLAG = "--trust-checkpoint"
_TRUST_ALL = frozenset({"1", "true", "yes", "all"})
_TRUST_NONE = frozenset({"0", "false", "no", "off"})

SafeGlobal = Callable[..., Any] | tuple[Callable[..., Any], str]


DATA_ONLY: tuple[SafeGlobal, ...] = (
    argparse.Namespace,  # object.__new__ + __dict__ update
    frozenset, range, slice,  # built from their items / bounds
    pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath,  # cls(*parts)
    datetime.date, datetime.time, datetime.datetime, datetime.timedelta, datetime.timezone,  # cls(fields)
    collections.OrderedDict, collections.Counter,  # cls(items); torch allows both already
    collections.ChainMap,  # object.__new__ + __dict__ update ({"maps": [...]})
)  # fmt: skip
"""The one allow-list of data-only classes (docs/checkpoints.md says why each is safe to rebuild); numpy's
are added when numpy is installed, and Hugging Face configs are found per file (``hf_configs``).
``collections.defaultdict`` and ``deque`` are not here: torch's safe unpickler cannot fill them (they load
when signed)."""


@functools.cache
def harmless_globals() -> tuple[SafeGlobal, ...]:
    """``DATA_ONLY`` plus numpy's scalars, arrays and dtypes."""
    return DATA_ONLY + _numpy_globals()


def _numpy_globals() -> tuple[SafeGlobal, ...]:
    """numpy scalars (``scalar(dtype, bytes)``), dtypes and their numpy 2 classes, plain arrays.

    Files written under numpy 1.x name ``numpy.core.multiarray``; both spellings are listed.
    """
    try:
        import numpy as np
    except ImportError:
        return ()
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    found: list[SafeGlobal] = [np.dtype, np.ndarray]
    for name in ("scalar", "_reconstruct"):
        function = getattr(core.multiarray, name)
        found += [(function, f"numpy._core.multiarray.{name}"), (function, f"numpy.core.multiarray.{name}")]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25: every dtype instance has its own class
    if dtypes is not None:
        found += sorted({c for c in vars(dtypes).values() if isinstance(c, type) and issubclass(c, np.dtype)},
                        key=lambda c: c.__name__)  # fmt: skip
    return tuple(found)


@contextmanager
def allow_harmless(path: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Allow the harmless globals for the loads inside, leaving the user's own allow-list as it was.

    With ``path``, also the data-only Hugging Face config classes that file names (``hf_configs``): the
    hook for every loader of a job's own files (SMP v1 and v2 formats alike).
    """
    present = set(get_safe_globals())
    extra = tuple(config_classes(path)) if path is not None else ()
    added = [g for g in harmless_globals() + extra if g not in present]
    with safe_globals(added):
        yield


def is_trusted(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SMP_COMPAT_TRUST_CHECKPOINTS`` trusts ``path``: ``1`` all, ``0`` none, else the folders listed."""
    value = (os.environ if environ is None else environ).get(TRUST_ENV, "").strip()
    if not value or value.lower() in _TRUST_NONE:
        return False
    if value.lower() in _TRUST_ALL:
        return True
    target = Path(path).resolve()
    for entry in value.split(os.pathsep):
        if entry.strip() and target.is_relative_to(Path(entry.strip()).expanduser().resolve()):
            return True
    return False


def trust_value(folders: list[str], current: str | None) -> str:
    """``SMP_COMPAT_TRUST_CHECKPOINTS`` with ``folders`` (made absolute) added to what it already says."""
    if current and current.strip().lower() in _TRUST_ALL:
        return current
    kept = "" if not current or current.strip().lower() in _TRUST_NONE else current
    entries = [e for e in kept.split(os.pathsep) if e.strip()]
    return os.pathsep.join([*entries, *(str(Path(f).expanduser().resolve()) for f in folders)])


def refusal_message(path: str | os.PathLike[str], error: BaseException, folder: str | os.PathLike[str]) -> str:
    """Why ``path`` did not load, and the three ways to trust it (two need no change to the script)."""
    return (
        f"{path} holds Python objects that safe loading refuses ({_what_was_refused(error)}). If you trust "
        f"this checkpoint, load it without changing the script: set {TRUST_ENV}={folder} (folders separated "
        f"by {os.pathsep!r}, or 1 to trust every file), or launch with `smp-compat run {TRUST_FLAG} {folder} "
        "...`; or, in the script, pass weights_only=False to smp.load / smp.resume_from_checkpoint."
    )


def _what_was_refused(error: BaseException) -> str:
    """torch's key sentence (``Unsupported global: GLOBAL x.Y was not an allowed global by default``)."""
    text = str(error)
    match = re.search(r"WeightsUnpickler error:\s*(.*?)(?: Please use|\n|$)", text)
    if match:
        return match.group(1).strip()
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
