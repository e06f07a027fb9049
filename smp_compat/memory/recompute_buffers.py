"""Recomputation must not update module buffers a second time (BatchNorm's running statistics).

Activation checkpointing runs a module's forward again in backward. A forward that updates buffers in
place (BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) then updates them twice per
step: same gradients, but silently different statistics, so evaluation differs from the unchecked model.
torch's own ``checkpoint`` does the same. Here the first forward notes which modules changed a buffer, and
the recomputation of those modules' buffers is undone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["buffer_guard"]

ContextPair = tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]


def buffer_guard(modules: Sequence[nn.Module]) -> Callable[[], ContextPair]:
    """A ``context_fn`` for torch's non-reentrant checkpoint: (first forward, recomputation) contexts."""

    def context_fn() -> ContextPair:
        changed: list[torch.Tensor] = []
        return _watch(modules, changed), _restore(changed)

    return context_fn


@contextlib.contextmanager
def _watch(modules: Sequence[nn.Module], changed: list[torch.Tensor]) -> Iterator[None]:
    """Every buffer of each submodule that changed one in place. A module, not single buffers: BatchNorm's
    kernel updates its running statistics without bumping their version; only ``num_batches_tracked`` shows."""
    owners = [m for root in modules for m in root.modules() if next(m.buffers(recurse=False), None) is not None]
    before = [[b._version for b in m.buffers(recurse=False)] for m in owners]
    yield
    for module, versions in zip(owners, before):
        buffers = list(module.buffers(recurse=False))
        if [b._version for b in buffers] != versions:
            changed.extend(buffers)


@contextlib.contextmanager
def _restore(changed: list[torch.Tensor]) -> Iterator[None]:
    saved = [b.detach().clone() for b in changed]
    try:
        yield  # torch ends a recomputation early by raising through here once it has what backward needs
    finally:
        for buffer, value in zip(changed, saved):
            # through .data: the recomputed graph saved these buffers at their current version (BatchNorm's
            # backward takes the running statistics as inputs), and a tracked write would invalidate it
            buffer.data.copy_(value)
