"""Hugging Face configs in a checkpoint file: found by name, allowed for safe loading when they only hold data.

Scripts keep their model's config in ``user_content`` (AWS's GPT-2 scripts do), and a pickled
``PretrainedConfig`` names its class, which safe loading refuses. A config pickles as "a bare instance of
the class, then its ``__dict__``", so loading it runs ``object.__new__`` and a dict update: no code of the
file's choosing. The classes a file names are read from its pickle's ``GLOBAL`` records (torch's safe
unpickler reads no other kind), and one is allowed only when it is a ``PretrainedConfig`` or
``GenerationConfig`` subclass defined in a ``transformers`` configuration module, rebuilt exactly as above
(no ``__new__``, ``__setstate__`` or ``__reduce__`` of its own). Remote-code configs
(``transformers_modules.*``, code downloaded with a model) are never allowed.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import pickletools
import re
import sys
import zipfile
from typing import Any

__all__ = ["config_classes", "named_globals", "is_data_only_config"]

_MODULE = re.compile(r"transformers(\.[A-Za-z_][A-Za-z0-9_]*)*\.configuration_[A-Za-z0-9_]+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def named_globals(path: str | os.PathLike[str]) -> set[tuple[str, str]]:
    """The ``(module, name)`` of every GLOBAL in a ``torch.save`` zip file's pickle (empty for other files)."""
    try:
        with zipfile.ZipFile(path) as archive:
            record = next((n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1), None)
            data = archive.read(record) if record is not None else b""
    except (OSError, zipfile.BadZipFile, KeyError):
        return set()
    found: set[tuple[str, str]] = set()
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
            if opcode.name == "GLOBAL" and isinstance(arg, str) and " " in arg:
                module, name = arg.split(" ", 1)
                found.add((module, name))
    except ValueError:  # damaged bytes: the load itself reports them
        pass
    return found


def _config_bases() -> tuple[type, ...]:
    """PretrainedConfig (PreTrainedConfig in transformers 5) and GenerationConfig."""
    from transformers.configuration_utils import PretrainedConfig
    from transformers.generation.configuration_utils import GenerationConfig

    return (PretrainedConfig, GenerationConfig)


def is_data_only_config(cls: Any) -> bool:
    """A transformers config class a pickle rebuilds with ``object.__new__`` and a ``__dict__`` update only."""
    if not isinstance(cls, type) or not _MODULE.fullmatch(cls.__module__):
        return False
    if not issubclass(cls, _config_bases()) or cls.__new__ is not object.__new__:
        return False
    if getattr(cls, "__setstate__", None) is not None:
        return False
    return cls.__reduce__ is object.__reduce__ and cls.__reduce_ex__ is object.__reduce_ex__


def config_classes(path: str | os.PathLike[str]) -> list[type]:
    """The data-only transformers config classes ``path`` names (importing only transformers' config modules)."""
    if not isinstance(path, (str, os.PathLike)):
        return []
    wanted = [(m, n) for m, n in sorted(named_globals(path)) if _MODULE.fullmatch(m) and _NAME.fullmatch(n)]
    if not wanted or ("transformers" not in sys.modules and importlib.util.find_spec("transformers") is None):
        return []
    found = []
    for module, name in wanted:
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if is_data_only_config(cls):
            found.append(cls)
    return found
