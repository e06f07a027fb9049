"""The interception: class attributes of PyTorch's ``FullyShardedDataParallel`` that defer to the façade.

Installed once (by ``tsm.init`` or ``import torch.sagemaker``); each patched attribute does exactly what
PyTorch's does unless the façade is active (``tsm.init()`` ran) and, for the static methods, the module
given contains a façade root. So plain FSDP1 objects keep stock behaviour in the same process.

* ``FullyShardedDataParallel.__new__``: after ``tsm.init()`` it returns the FSDP2-sharded module
  (build.py). Python skips ``__init__`` because that object is not an FSDP1 instance.
* ``state_dict_type``, ``set_state_dict_type``, ``optim_state_dict``, ``optim_state_dict_to_load``:
  state_dicts.py for façade models; ``summon_full_params`` refuses them (FSDP1's would silently do nothing).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from smp_compat.errors import SMPUnsupportedError
from smp_compat.v2.fsdp import build, context, reshard, state_dicts

__all__ = ["install", "installed"]

_ORIGINAL: dict[str, Any] = {}


def installed() -> bool:
    return bool(_ORIGINAL)


def install() -> None:
    """Patch the FSDP1 class (idempotent)."""
    if _ORIGINAL:
        return
    for name in ("state_dict_type", "set_state_dict_type", "optim_state_dict", "optim_state_dict_to_load",
                 "summon_full_params"):  # fmt: skip
        _ORIGINAL[name] = FSDP.__dict__[name]
    FSDP.__new__ = staticmethod(_new)  # type: ignore[method-assign,assignment]
    FSDP.state_dict_type = staticmethod(_state_dict_type)  # type: ignore[method-assign,assignment]
    FSDP.set_state_dict_type = staticmethod(_set_state_dict_type)  # type: ignore[method-assign,assignment]
    FSDP.optim_state_dict = staticmethod(_optim_state_dict)  # type: ignore[method-assign,assignment]
    FSDP.optim_state_dict_to_load = staticmethod(_optim_state_dict_to_load)  # type: ignore[method-assign,assignment]
    FSDP.summon_full_params = staticmethod(_summon_full_params)  # type: ignore[method-assign,assignment]


def _new(cls: type, module: nn.Module | None = None, *args: Any, **kwargs: Any) -> Any:
    ctx = context.current()
    if ctx is None or cls is not FSDP or module is None:
        return object.__new__(cls)  # FSDP1 and its bases define no __new__ of their own
    root = build.build(ctx, module, *args, **kwargs)
    state_dicts.install_hooks(root)
    reshard.install(root)
    return root


def _original(name: str) -> Any:
    return _ORIGINAL[name].__func__


@contextlib.contextmanager
def _facade_type(roots: list[nn.Module], *args: Any) -> Iterator[None]:
    with state_dicts.use_type(roots, *args):
        yield


def _state_dict_type(
    module: nn.Module, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> Any:
    roots = state_dicts.roots_in(module)
    if not roots:
        return _original("state_dict_type")(module, state_dict_type, state_dict_config, optim_state_dict_config)
    return _facade_type(roots, state_dict_type, state_dict_config, optim_state_dict_config)


def _set_state_dict_type(
    module: nn.Module, state_dict_type: Any, state_dict_config: Any = None, optim_state_dict_config: Any = None
) -> Any:
    roots = state_dicts.roots_in(module)
    if not roots:
        return _original("set_state_dict_type")(module, state_dict_type, state_dict_config, optim_state_dict_config)
    for r in roots:
        state_dicts.set_type(build.facade_state(r), state_dict_type, state_dict_config, optim_state_dict_config)
    return None


def _optim_state_dict(model: nn.Module, optim: Any, optim_state_dict: Any = None, group: Any = None) -> Any:
    roots = state_dicts.roots_in(model)
    if not roots:
        return _original("optim_state_dict")(model, optim, optim_state_dict, group)
    return state_dicts.optim_state_dict(model, optim, roots[0])


@functools.wraps(FSDP.optim_state_dict_to_load)
def _optim_state_dict_to_load(model: nn.Module, optim: Any, optim_state_dict: Any, *args: Any, **kwargs: Any) -> Any:
    roots = state_dicts.roots_in(model)
    if not roots:
        return _original("optim_state_dict_to_load")(model, optim, optim_state_dict, *args, **kwargs)
    return state_dicts.optim_state_dict_to_load(model, optim, optim_state_dict, roots[0])


def _summon_full_params(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not state_dicts.roots_in(module):
        return _original("summon_full_params")(module, *args, **kwargs)
    raise SMPUnsupportedError(
        "FSDP.summon_full_params on a model sharded after tsm.init() (FSDP2): use FSDP.state_dict_type(model, "
        "StateDictType.FULL_STATE_DICT) and model.state_dict() for full weights."
    )
