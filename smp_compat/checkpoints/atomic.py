"""Atomic, signed file writes and the safe-load refusal test: the pieces every saver shares.

SMP v1's files (``serialization``, ``folders``) and the SMP v2 scripts' own ``torch.save`` files
(``smp_compat.v2.signed_files``) are written the same way. This module imports no job state, so that
``import torch.sagemaker`` does not bring in v1's process-wide state with it.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from smp_compat.checkpoints import signing

__all__ = ["atomic_write", "atomic_save", "fsync_dir", "is_refusal"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync, then rename: never a half-written file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def atomic_save(obj: Any, path: str | os.PathLike[str], **save_kwargs: Any) -> None:
    """``torch.save`` through ``atomic_write``, then its keyed digest beside it (``signing``).

    The digest is written second: a process killed between the two leaves a file whose digest does
    not match, which safe loading still reads and anything more refuses.
    """
    mac = signing.new_mac(signing.user_key())
    atomic_write(path, lambda handle: torch.save(obj, signing.DigestingWriter(handle, mac), **save_kwargs))
    digest = mac.hexdigest()
    atomic_write(signing.digest_path(path), lambda handle: handle.write(digest.encode("ascii")))


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_refusal(exc: pickle.UnpicklingError) -> bool:
    """torch's safe unpickler refused a type; "Unsupported operand" means damaged bytes, not a refusal."""
    text = str(exc)
    return "WeightsUnpickler error" in text and "Unsupported operand" not in text
