"""Manual partitioning: ``smp.partition`` contexts, ``smp.set_partition``, and the plan they describe."""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from smp_compat.errors import PartitionError
from smp_compat.partitioning.plan import PartitionPlan, check_shared_together, state_modules
from smp_compat.globalstate import state

__all__ = ["carry_partition", "clear_records", "manual_plan", "partition", "set_partition"]

# Where each module was created (innermost smp.partition context) and where set_partition put it.
_created: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_explicit: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

_lock = threading.Lock()
_local = threading.local()
_active = 0
_original_init: Callable[..., None] | None = None
_wrapper: Callable[..., None] | None = None


def _stack() -> list[int]:
    """This thread's open partition indices; other threads' modules are not ours to record."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _acts() -> bool:
    """smp.partition and set_partition only act after init and with auto_partition off (SMP)."""
    return state.initialized and state.cfg is not None and not state.cfg.auto_partition


def _pp_size() -> int:
    return state.cfg.pipeline_parallel_degree if state.cfg is not None else 1


def _check_index(index: Any, what: str) -> int:
    pp = _pp_size()
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < pp:
        raise PartitionError(
            f"{what} got partition index {index!r}, but it must be an int from 0 to {pp - 1} "
            f"(pipeline_parallel_degree={pp}). Pass a stage index in that range."
        )
    return index


def _install() -> None:
    """Wrap nn.Module.__init__ so each new module records the innermost open partition index."""
    global _active, _original_init, _wrapper
    with _lock:
        _active += 1
        if _active > 1:
            return
        original = nn.Module.__init__

        @functools.wraps(original)
        def recording_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            stack = _stack()
            if stack:
                _created[self] = stack[-1]

        _original_init, _wrapper = original, recording_init
        nn.Module.__init__ = recording_init  # type: ignore[method-assign]


def _uninstall() -> None:
    """Restore nn.Module.__init__ when the outermost context closes, unless someone wrapped it after us."""
    global _active, _original_init, _wrapper
    with _lock:
        _active -= 1
        if _active > 0:
            return
        if nn.Module.__init__ is _wrapper and _original_init is not None:
            nn.Module.__init__ = _original_init  # type: ignore[method-assign]
        # Otherwise a later patch sits on top of ours; ours stays but records nothing with no open context.
        _original_init, _wrapper = None, None


@contextmanager
def partition(index: int) -> Iterator[None]:
    """``smp.partition(i)``: modules created inside go to pipeline stage ``i``; the innermost block wins.

    Does nothing (but is still a valid context) before ``smp.init`` or when ``auto_partition`` is on.
    """
    if not _acts():
        yield
        return
    _check_index(index, "smp.partition")
    _install()
    stack = _stack()
    stack.append(index)
    try:
        yield
    finally:
        stack.pop()
        _uninstall()


def set_partition(module: nn.Module, partition: int, recurse: bool = True) -> None:
    """``smp.set_partition``: put an existing module (and by default its descendants) on ``partition``.

    Overrides ``smp.partition`` records. Ignored with a warning under auto_partition, as in SMP.
    """
    state.require_init("smp.set_partition")
    if not isinstance(module, nn.Module):
        raise PartitionError(
            f"smp.set_partition expects an nn.Module, got {type(module).__name__}. Pass the module instance "
            "(e.g. model.module.layer) whose stage you want to set."
        )
    if state.cfg is not None and state.cfg.auto_partition:
        warnings.warn(
            "smp.set_partition is ignored because auto_partition is True; set auto_partition: False (with a "
            "default_partition) to place modules by hand.",
            stacklevel=2,
        )
        return
    if state.model is not None and getattr(state.model, "partitioned", False):
        raise PartitionError(
            "smp.set_partition was called after the model was partitioned (partitioning happens in the first "
            "@smp.step call). Call it between creating the DistributedModel and the first step."
        )
    _check_index(partition, "smp.set_partition")
    targets = module.modules() if recurse else iter((module,))
    for target in targets:
        _explicit[target] = partition


def clear_records() -> None:
    """Forget every smp.partition and set_partition record (tests, and scripts that re-init)."""
    _created.clear()
    _explicit.clear()


def carry_partition(old: nn.Module, new: nn.Module, pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """A module swapped for tensor parallelism keeps its smp.partition / set_partition stage.

    The replacement's new modules get ``old``'s stage (modules it took over keep their own); then each
    ``(old block, new layer)`` pair carries the block's own stage to the layer's subtree, so blocks created
    in different ``smp.partition`` contexts stay on their stages after the swap.
    """
    for source, target, override in [(old, new, False), *((a, b, True) for a, b in pairs)]:
        table = _explicit if source in _explicit else _created
        rank = table.get(source)
        if rank is None:
            continue
        for module in target.modules():
            if override or _recorded(module) is None:
                table[module] = rank


def _recorded(module: nn.Module) -> int | None:
    """set_partition beats the creation context."""
    if module in _explicit:
        return _explicit[module]
    return _created.get(module)


def manual_plan(root: nn.Module, pp_size: int, default_partition: int | None) -> PartitionPlan:
    """The plan of a manually partitioned model: recorded stage, else ``default_partition``.

    As in SMP, every module not assigned goes to ``default_partition`` (containers and children
    created outside any block included); the root's own state always stays on rank 0.
    """
    assignment: dict[str, int] = {}
    unassigned: list[str] = []
    modules = dict(root.named_modules())
    for name in state_modules(root):
        rank = _recorded(modules[name])
        if rank is None:
            rank = default_partition
        if rank is None:
            unassigned.append(name)
            continue
        assignment[name] = _checked_rank(name, rank, pp_size)
    if unassigned:
        raise PartitionError(
            f"Modules {', '.join(repr(n or '(root)') for n in unassigned[:10])} were created outside any "
            "smp.partition block and no default_partition is set. Set default_partition in the config, or "
            "place them with smp.partition / smp.set_partition."
        )
    _force_root_to_zero(assignment)
    check_shared_together(root, assignment)
    return PartitionPlan(assignment=assignment, pp_size=pp_size, method="manual")


def _checked_rank(name: str, rank: int, pp_size: int) -> int:
    if not 0 <= rank < pp_size:
        raise PartitionError(
            f"Module {name or '(root)'!r} is placed on partition {rank}, but pipeline_parallel_degree is {pp_size}. "
            f"Use partition indices from 0 to {pp_size - 1}."
        )
    return rank


def _force_root_to_zero(assignment: dict[str, int]) -> None:
    """The root module's own code and state run on rank 0 in SMP, whatever the user asked."""
    if "" in assignment and assignment[""] != 0:
        warnings.warn(
            f"The root module was placed on partition {assignment['']}, but its own parameters and buffers always "
            "live on partition 0 (as in SMP); they are placed there. Its children keep their partitions.",
            stacklevel=3,
        )
        assignment[""] = 0
