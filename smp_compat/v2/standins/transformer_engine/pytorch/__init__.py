"""Stand-in for ``transformer_engine.pytorch``: ``fp8_autocast`` (no fp8) and ``checkpoint`` (torch's)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint

from smp_compat.v2.standins import absent_names, announce
from smp_compat.v2.standins.transformer_engine.pytorch import attention

__all__ = ["attention", "checkpoint", "fp8_autocast"]


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Any = None, fp8_group: Any = None,
                 **kwargs: Any) -> Iterator[None]:  # fmt: skip
    """Run the block unchanged: without Transformer Engine there is no fp8 (announced once when enabled)."""
    if enabled:
        announce("fp8", "fp8_autocast(enabled=True) without Transformer Engine: fp8 is off, the model runs in its "
                 "own precision (bf16 under the scripts' MixedPrecision).")  # fmt: skip
    yield


def checkpoint(function: Callable[..., Any], *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Callable[[], Any] | None = None, tp_group: Any = None,
               use_reentrant: bool = True, get_cuda_rng_tracker: Callable[[], Any] | None = None,
               **kwargs: Any) -> Any:  # fmt: skip
    """torch's activation checkpoint, accepting TE's extra arguments.

    ``get_cuda_rng_tracker`` is TE 1.2's name for ``get_rng_state_tracker`` (AWS's 2024 HyperPod scripts pass
    it); its streams are restored for the recomputation, as TE does, so dropout inside a ``tracker.fork()``
    draws the same numbers twice. ``use_reentrant`` defaults to True, the reentrant recomputation TE 1.2
    always did; keyword arguments for ``function`` then travel as positional inputs (torch's reentrant
    checkpoint takes none), so a tensor among them still gets its gradient. ``distribute_saved_activations``
    and ``tp_group`` (which split saved inputs over the tp group) only save memory; torch's checkpoint keeps
    whole inputs.
    """
    if get_rng_state_tracker is not None and get_cuda_rng_tracker is not None:
        raise TypeError("checkpoint() got both get_rng_state_tracker and get_cuda_rng_tracker (TE 1.2's name for it)")
    get_tracker = get_rng_state_tracker if get_rng_state_tracker is not None else get_cuda_rng_tracker
    if use_reentrant and kwargs:
        function, args, kwargs = _with_keywords_as_positional(function, args, kwargs)
    if get_tracker is not None:
        function = _replaying(function, get_tracker())
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def _with_keywords_as_positional(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``function(*args, **kwargs)`` as a function of positional inputs only (the reentrant checkpoint's form)."""
    keys = tuple(kwargs)

    def run(*inputs: Any) -> Any:
        split = len(inputs) - len(keys)
        return function(*inputs[:split], **dict(zip(keys, inputs[split:])))

    return run, (*args, *kwargs.values()), {}


def _replaying(function: Callable[..., Any], tracker: Any) -> Callable[..., Any]:
    """``function`` whose second call (the recomputation) runs with the tracker's streams of the first."""
    at_forward = tracker.get_states()
    calls = []

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        if not calls:  # the first (forward) pass
            calls.append(True)
            return function(*inner_args, **inner_kwargs)
        now = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            tracker.set_states(now)

    return run


__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
