"""A Megatron-style RNG state tracker: named generator states that ``fork()`` swaps in for a block.

Transformer Engine's ``checkpoint(get_rng_state_tracker=...)`` and tensor-parallel layers use it so that dropout
inside tensor-parallel regions draws from a stream seeded ``random_seed + tp_rank`` while the default stream
stays the same on every rank. Each tracked state holds the CPU generator's state and, where CUDA is in use,
the current device's CUDA generator state: on CPU, dropout draws from the CPU generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from smp_compat.errors import SMPConfigError

__all__ = ["MODEL_PARALLEL_RNG", "RNGStatesTracker"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""Megatron's name for the tensor-parallel stream, the default of ``fork``."""


@dataclass(frozen=True)
class GeneratorStates:
    """One tracked stream: the CPU generator's state and the CUDA one's (None without CUDA)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    def clone(self) -> GeneratorStates:
        return GeneratorStates(self.cpu.clone(), None if self.cuda is None else self.cuda.clone())


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _current() -> GeneratorStates:
    return GeneratorStates(torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda_in_use() else None)


def _restore(states: GeneratorStates) -> None:
    torch.set_rng_state(states.cpu)
    if states.cuda is not None and _cuda_in_use():
        torch.cuda.set_rng_state(states.cuda)


class RNGStatesTracker:
    """Named RNG streams (Megatron's ``CudaRNGStatesTracker`` API: reset, get_states, set_states, add, fork)."""

    def __init__(self) -> None:
        self._states: dict[str, GeneratorStates] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, GeneratorStates]:
        """A copy of every stream's state (TE's checkpoint saves it before a forward and restores it for recompute)."""
        return {name: states.clone() for name, states in self._states.items()}

    def set_states(self, states: dict[str, GeneratorStates]) -> None:
        """Replace every stream's state by ``states`` (as returned by :meth:`get_states`)."""
        self._states = {name: s.clone() for name, s in states.items()}

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed``; names and seeds must be new, as in Megatron."""
        if name in self._states:
            raise SMPConfigError(f"RNG state {name!r} is already tracked; pick another name.")
        if seed in self._seeds:
            raise SMPConfigError(f"seed {seed} already seeds another tracked RNG state; pick another seed.")
        outside = _current()
        try:
            torch.manual_seed(seed)  # seeds the CPU generator and every CUDA device's
            self._states[name] = _current()
        finally:
            _restore(outside)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream continues where it was afterwards."""
        if name not in self._states:
            raise SMPConfigError(f"RNG state {name!r} is not tracked (known: {sorted(self._states)}); add it first.")
        outside = _current()
        _restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _current()
            _restore(outside)
