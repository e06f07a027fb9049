"""Late weight gradients: a served backward replies with the input gradients before its weight gradients.

The caller of a remote module waits for the input gradients of each backward it sent; the weight gradients
matter only at the optimizer step. So the owner's large ``nn.Linear``-style products (``F.linear``) run as
``SplitLinear``: its backward computes only the input gradient and hands ``(input, output gradient)`` to a
``WeightGradients`` store; the engine sends the reply, then ``accumulate`` computes the weight gradients
with the very products autograd uses (bitwise the same values) and adds them to ``.grad`` as
``AccumulateGrad`` would: when this rank has nothing else to do, or after its next backward's reply, and
always before the step returns. Zero-bubble pipelines split the backward the same way (B before W).

Only plain cases split; anything else (autocast, saved-tensor hooks, ``torch.func`` transforms, hooks on the
parameter, a non-contiguous input, a backward outside the engine's, a small product) runs the usual product:
no result depends on it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "ENV", "MIN_MULTIPLY_ADDS", "Entry", "WeightGradients", "SplitLinear", "accumulate", "splitting_linears", "enabled",
]

ENV = "SMP_COMPAT_LATE_WEIGHT_GRADS"


def enabled(pp_size: int) -> bool:
    """Served backwards reply before their weight gradients unless ``SMP_COMPAT_LATE_WEIGHT_GRADS=0``."""
    return pp_size > 1 and os.environ.get(ENV, "1") != "0"


Entry = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]  # input, output grad, weight, bias


class WeightGradients:
    """The weight-gradient products of one owner's microbatch, kept from its backward until ``take``."""

    def __init__(self) -> None:
        self.collecting = False  # True only while the engine runs this owner's served backward
        self._entries: list[Entry] = []

    def add(self, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._entries.append((x2, dy2, weight, bias))

    def take(self) -> list[Entry]:
        """What one served backward left (each backward's products are added to ``.grad`` on their own)."""
        entries, self._entries = self._entries, []
        return entries


def accumulate(entries: list[Entry]) -> None:
    """The products into ``.grad``: a parameter's contributions summed in arrival order first, then added once,
    as autograd's input buffer and ``AccumulateGrad`` do within one backward. One parameter at a time, so each
    product's memory is reused for the next (all products alive at once took fresh pages: 2x slower)."""
    products: dict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]] = {}
    for x2, dy2, weight, bias in entries:
        products.setdefault(id(weight), (weight, []))[1].append((dy2, x2))
        if bias is not None:
            products.setdefault(id(bias), (bias, []))[1].append((dy2, None))
    with torch.no_grad():
        for param, terms in products.values():
            grad = None
            for dy2, x2 in terms:  # the products autograd computes for addmm / mm
                term = dy2.t().mm(x2) if x2 is not None else dy2.sum(0)
                grad = term if grad is None else grad + term
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


class SplitLinear(torch.autograd.Function):
    """``F.linear`` whose backward leaves the weight gradients to ``WeightGradients`` during a served backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradients) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, weight, bias)
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = dy2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        if ctx.store.collecting and not torch.is_grad_enabled():
            ctx.store.add(x2, dy2, weight, bias)
            return dx, None, None, None
        # any other backward (the user's own, a double backward) gets every gradient now, as F.linear would
        dw = dy2.t().mm(x2) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class splitting_linears(TorchFunctionMode):
    """Within a served forward: every plain ``F.linear`` call large enough to be worth it becomes a
    ``SplitLinear``."""

    def __init__(self, store: WeightGradients) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.linear and not kwargs and _plain(*args):
            return SplitLinear.apply(*args, *([None] if len(args) == 2 else []), self.store)
        return func(*args, **(kwargs or {}))


# Below this many multiply-adds a product's weight gradient takes ~0.5 ms on a CPU core or less, and moving it
# after the reply gained less than the split's fixed Python cost (~35 us per product: the Function, the check,
# the later accumulation) took from this rank: at 2^23 (pp = 2, width 512, microbatch 32) the split measured
# 0.93 of Schedule1F1B against 0.92-0.98 without it; at 2^26 (width 1024, microbatch 64) 1.04 against 0.97.
MIN_MULTIPLY_ADDS = 1 << 24


def _plain(x: Any, weight: Any, bias: Any = None) -> bool:
    """A large product whose gradients ``SplitLinear`` reproduces exactly and whose parameters nothing else
    watches (hooks on a parameter expect its gradient inside the backward)."""
    if type(x) is not torch.Tensor or type(weight) is not torch.nn.Parameter or x.dim() < 2:
        return False
    if x.numel() * weight.shape[0] < MIN_MULTIPLY_ADDS or x.layout != torch.strided or not x.is_contiguous():
        return False
    params = (weight,) if bias is None else (weight, bias)
    return all(
        type(p) is torch.nn.Parameter and p.requires_grad and p.dtype == x.dtype and p.device == x.device
        and p.layout == torch.strided and p.is_contiguous() and not p._backward_hooks
        and not p._post_accumulate_grad_hooks for p in params
    ) and not torch.is_autocast_enabled(x.device.type) and not _hooks_or_transforms_on()  # fmt: skip


def _hooks_or_transforms_on() -> bool:
    """Saved-tensor hooks (non-reentrant ``checkpoint``, ``save_on_cpu``) see what each node saves: a
    checkpoint's recomputation, which runs outside this mode, must save exactly what the forward saved.
    ``torch.func`` transforms (``vmap``, ``grad``) need Functions with ``setup_context``, and theirs is not
    an engine-driven backward anyway."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    forward_ad = torch.autograd.forward_ad._current_level >= 0  # dual tensors need a Function's jvp
    return hooks or forward_ad or torch._C._functorch.maybe_current_level() is not None
