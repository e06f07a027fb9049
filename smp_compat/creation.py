"""``smp.model_creation`` and ``smp.delay_param_initialization``: build big models without materializing them.

Under delayed initialization, modules are created on the meta device (no memory). When the model is
partitioned, each rank materializes only the modules it owns and initializes them with their own
``reset_parameters()``, so no process ever holds the whole model. A module with parameters of its own
but no ``reset_parameters()`` has no initializer to replay: that is an error naming it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from smp_compat.errors import SMPUnsupportedError
from smp_compat.globalstate import state

__all__ = ["model_creation", "delay_param_initialization", "is_delayed", "materialize_local", "replace_in_place"]

_delayed: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Modules created inside hold no memory until the model is partitioned."""
    if not enabled:
        yield
        return
    with torch.device("meta"):
        yield


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **tensor_parallel_config: Any) -> Iterator[None]:
    """Create the model with ``dtype`` as default dtype, delayed when the config asks for it (SMP >= 1.10)."""
    from smp_compat.nn.registry import tensor_parallelism as tp_context

    delayed = bool(state.initialized and state.cfg.delayed_parameter_initialization)
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        tp = tp_context(True, **tensor_parallel_config) if tensor_parallelism else contextlib.nullcontext()
        with delay_param_initialization(delayed), tp:
            yield
    finally:
        torch.set_default_dtype(previous)


def is_delayed(root: nn.Module) -> bool:
    """True if some parameter or buffer of ``root`` still lives on the meta device."""
    return any(t.is_meta for t in root.parameters()) or any(t.is_meta for t in root.buffers())


def materialize_local(modules: list[nn.Module], device: torch.device) -> None:
    """Allocate and initialize ``modules`` (this rank's own) that were created with delayed initialization."""
    pending = [m for m in modules if _owns_meta(m)]
    missing = [type(m).__name__ for m in pending if not hasattr(m, "reset_parameters")]
    if missing:
        raise SMPUnsupportedError(
            f"delayed initialization of modules without reset_parameters(): {', '.join(sorted(set(missing)))}. "
            "Give them a reset_parameters() method that initializes their own parameters, or create them "
            "outside smp.delay_param_initialization()"
        )
    for module in pending:
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is not None and t.is_meta:
                    replace_in_place(t, torch.empty_like(t, device=device))
    with torch.no_grad():
        for module in pending:
            module.reset_parameters()


def replace_in_place(t: torch.Tensor, data: torch.Tensor) -> None:
    """Give ``t`` new storage, keeping the Python object, so optimizers built earlier still hold it.

    ``.data =`` cannot turn a meta tensor into a real one; ``swap_tensors`` can.
    """
    if isinstance(t, nn.Parameter):
        data = nn.Parameter(data, requires_grad=t.requires_grad)
    data.__dict__.update(t.__dict__)  # swap_tensors swaps __dict__ too: keep markers such as a tp shard's dim
    torch.utils.swap_tensors(t, data)


def _owns_meta(module: nn.Module) -> bool:
    own = list(module._parameters.values()) + list(module._buffers.values())
    return any(t is not None and t.is_meta for t in own)
