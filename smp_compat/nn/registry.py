"""Which modules have a distributed version, and which instances were marked for tensor parallelism.

``tp_register``/``tp_register_with_module`` fill the registry and wrap the class's ``__init__`` so every
instance remembers its constructor arguments (the ``init_hook`` needs them later). The
``tensor_parallelism`` context and ``set_tensor_parallelism`` only *mark* instances; the replacement
itself happens in ``smp.DistributedModel`` (swap.py).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from smp_compat.errors import SMPConfigError

__all__ = ["tp_register", "tp_register_with_module", "tensor_parallelism", "set_tensor_parallelism",
           "Registration", "lookup", "mark_of", "install_builtins"]  # fmt: skip

Hook = Callable[..., Any]


@dataclass
class Registration:
    """A supported class: its distributed module and SMP's three hooks; ``build`` replaces the generic path
    (used by built-ins such as Hugging Face GPT-2, which build from the instance itself)."""

    dist_cls: type | None
    init_hook: Hook | None = None
    forward_hook: Hook | None = None
    return_hook: Hook | None = None
    build: Callable[[nn.Module, dict[str, Any]], nn.Module] | None = None


_registry: dict[type, Registration] = {}
requested = False
"""Whether the script asked for tensor parallelism anywhere (for the one log line when nothing is supported)."""
_local = threading.local()
_MARK = "_smp_tp_mark"
_ARGS = "_smp_tp_init_args"


def _stack() -> list[tuple[bool, dict[str, Any]]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def lookup(cls: type) -> Registration | None:
    """The registration of ``cls`` or its nearest registered base class."""
    for klass in cls.__mro__:
        if klass in _registry:
            return _registry[klass]
    return None


def mark_of(module: nn.Module) -> tuple[bool, dict[str, Any]] | None:
    """(enabled, kwargs) recorded for ``module``, or None if it was never marked."""
    return module.__dict__.get(_MARK)


def init_args_of(module: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    return module.__dict__.get(_ARGS)


def _wrap_init(cls: type) -> None:
    """Record constructor arguments and the innermost tensor_parallelism context on every new instance."""
    if "_smp_tp_wrapped" in cls.__dict__:
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original(self, *args, **kwargs)
        if type(self) is cls or _ARGS not in self.__dict__:
            self.__dict__[_ARGS] = (args, kwargs)
        stack = _stack()
        if stack:
            self.__dict__[_MARK] = stack[-1]

    cls.__init__ = __init__
    cls._smp_tp_wrapped = True


def tp_register_with_module(
    module_cls: type, dist_module: type, init_hook: Hook | None = None, forward_hook: Hook | None = None,
    return_hook: Hook | None = None,
) -> None:  # fmt: skip
    """Register ``dist_module`` (an ``smp.nn.DistributedModule`` subclass) as the tp version of ``module_cls``."""
    from smp_compat.nn.module import DistributedModule

    if not (isinstance(dist_module, type) and issubclass(dist_module, DistributedModule)):
        raise SMPConfigError(
            f"tp_register needs a subclass of smp.nn.DistributedModule as the distributed module, got {dist_module!r}."
        )
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise SMPConfigError(f"tp_register_with_module needs an nn.Module class, got {module_cls!r}.")
    _registry[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook)
    _wrap_init(module_cls)


def tp_register(
    dist_module: type, init_hook: Hook | None = None, forward_hook: Hook | None = None, return_hook: Hook | None = None
) -> Callable[[type], type]:
    """Class decorator form of :func:`tp_register_with_module`."""

    def decorate(cls: type) -> type:
        tp_register_with_module(cls, dist_module, init_hook, forward_hook, return_hook)
        return cls

    return decorate


def register_builtin(module_cls: type, build: Callable[[nn.Module, dict[str, Any]], nn.Module]) -> None:
    if module_cls not in _registry:
        _registry[module_cls] = Registration(None, build=build)
        _wrap_init(module_cls)


def install_builtins() -> None:
    """Register the Hugging Face models we support, if the script uses transformers (never import it ourselves)."""
    if "transformers" in sys.modules:
        from smp_compat.nn.huggingface import register_all

        register_all()


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Supported modules created inside are marked for tensor parallelism (the innermost context wins);
    ``kwargs`` override same-named constructor arguments of the distributed module."""
    install_builtins()
    global requested
    requested = requested or bool(enabled)
    stack = _stack()
    stack.append((bool(enabled), dict(kwargs)))
    try:
        yield
    finally:
        stack.pop()


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """After construction: enabling marks the outermost supported submodules of ``module`` (itself included);
    disabling unmarks the whole subtree."""
    install_builtins()
    if not isinstance(module, nn.Module):
        raise SMPConfigError(f"smp.set_tensor_parallelism expects an nn.Module, got {type(module).__name__}.")
    global requested
    requested = requested or bool(enabled)
    if not enabled:
        for sub in module.modules():
            sub.__dict__[_MARK] = (False, {})
        return
    _mark_outermost(module, dict(kwargs))


def _mark_outermost(module: nn.Module, kwargs: dict[str, Any]) -> None:
    if lookup(type(module)) is not None:
        module.__dict__[_MARK] = (True, kwargs)
        return
    for child in module.children():
        _mark_outermost(child, kwargs)
