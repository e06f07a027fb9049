"""Deterministic gradient accumulation for pipelined steps (``deterministic_server: True``).

Microbatches' backward segments reach a rank in arrival order, and floating-point addition is not
associative, so two identical runs can differ in the last bits. In this mode each microbatch's
contributions to a local parameter are kept apart and added in microbatch order when the step ends:
identical runs (and a resumed run) then match bit for bit, at the cost of one gradient buffer per
microbatch while the step runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["OrderedGradients"]


class OrderedGradients:
    """Per-microbatch gradient buffers of this rank's parameters, summed in microbatch order."""

    def __init__(self, params: list[nn.Parameter], current_microbatch: Callable[[], int | None]) -> None:
        self.params = params
        self.current_microbatch = current_microbatch
        self.previous: dict[int, torch.Tensor | None] = {}
        self.buffers: dict[int, dict[int, torch.Tensor]] = {}
        self.handles = [p.register_post_accumulate_grad_hook(self._take) for p in params]

    def begin_step(self) -> None:
        """Set aside gradients accumulated by earlier steps (backward_passes_per_step > 1)."""
        self.previous = {id(p): p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        self.buffers = {}

    def _take(self, p: nn.Parameter) -> None:
        mb = self.current_microbatch()
        if mb is None or p.grad is None:
            return
        mine = self.buffers.setdefault(mb, {})
        if id(p) in mine:
            mine[id(p)] += p.grad
        else:
            mine[id(p)] = p.grad
        p.grad = None

    def end_step(self) -> None:
        """Earlier gradients, then every microbatch's contribution, in microbatch order."""
        for p in self.params:
            total = self.previous.get(id(p))
            for mb in sorted(self.buffers):
                g = self.buffers[mb].get(id(p))
                if g is not None:
                    total = g if total is None else total + g
            p.grad = total
        self.previous, self.buffers = {}, {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
