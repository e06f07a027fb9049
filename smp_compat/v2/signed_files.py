"""The script's own ``torch.save`` files load again with its own ``torch.load``, as on SageMaker.

The v2 scripts' ``local`` checkpoint is ``torch.save({"model", "optimizer", ..., "model_config": <HF config>},
f"{rank}.pt")`` and, on resume, a plain ``torch.load`` of that file. Since torch 2.6 ``torch.load`` is
weights-only by default and refuses the Hugging Face config (SMP's PyTorch 2.0-2.5 did not). As for v1
checkpoints (``smp_compat.checkpoints.signing``), after ``tsm.init()`` a ``torch.save`` to a path is written
atomically with a keyed digest beside it (``<file>.hmac``), and a ``torch.load`` that did not choose
``weights_only`` and is refused by safe loading loads again with the data-only allow-list (a Hugging Face config,
``argparse.Namespace``, ...: ``checkpoints.load_policy``), so a restart in a fresh container with an empty home
still reads it; anything else loads in full only when its digest verifies under this user's key: the job's own files load with no flag; a file from elsewhere or changed since is refused
as before. Explicit ``weights_only=...`` arguments are always obeyed.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from smp_compat.checkpoints import signing
from smp_compat.checkpoints.atomic import atomic_save, is_refusal
from smp_compat.checkpoints.load_policy import allow_harmless

__all__ = ["install", "STOCK"]

STOCK: dict[str, Callable[..., Any]] = {}
_MARK = "__smp_compat_v2_wrapper__"


def _active() -> bool:
    from smp_compat.v2.dcp_compat import v2_initialized

    return v2_initialized()


def _save_wrapper() -> Callable[..., Any]:
    stock = STOCK["save"]

    @functools.wraps(stock)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and isinstance(f, (str, os.PathLike)) and _active():
            return atomic_save(obj, f, **kwargs)  # its torch.save gets a file object: stock
        return stock(obj, f, *args, **kwargs)

    setattr(save, _MARK, True)
    return save


def _load_wrapper() -> Callable[..., Any]:
    stock = STOCK["load"]

    @functools.wraps(stock)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        chose = kwargs.get("weights_only") is not None
        if chose or not isinstance(f, (str, os.PathLike)) or not _active():
            return stock(f, *args, **kwargs)
        try:
            return stock(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            if not is_refusal(exc):
                raise
        try:  # data-only objects (a Hugging Face config, Namespace, ...): no key needed, as for v1 files
            with allow_harmless(f):
                return stock(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            if not is_refusal(exc):
                raise
            data = Path(f).read_bytes()  # read once: what is checked is what loads
            if not signing.verifies(f, data):
                raise
            return stock(io.BytesIO(data), *args, **{**kwargs, "weights_only": False})

    setattr(load, _MARK, True)
    return load


def install() -> None:
    """Wrap ``torch.save`` / ``torch.load`` (idempotent); they pass through until ``tsm.init()``."""
    if STOCK:
        return
    STOCK["save"], STOCK["load"] = torch.save, torch.load
    if not getattr(torch.save, _MARK, False):
        torch.save = _save_wrapper()
    if not getattr(torch.load, _MARK, False):
        torch.load = _load_wrapper()
