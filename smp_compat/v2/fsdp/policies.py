"""FSDP1 auto-wrap policies as FSDP2 units: which submodules get their own ``fully_shard``.

The scripts pass ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer})``; the
lambda policy, ``ModuleWrapPolicy`` and ``CustomPolicy`` (boolean answers) mean the same kind of choice
and are honoured too. A size-based or combined policy depends on FSDP1's recursive wrapping, which the
façade does not run: it is refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from smp_compat.errors import SMPUnsupportedError

__all__ = ["units"]


def units(root: nn.Module, policy: Any) -> list[nn.Module]:
    """Submodules the policy wraps, inner ones before the ones containing them, in forward order otherwise."""
    if policy is None:
        return []
    chosen = _predicate(policy)
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
            if _answer(chosen(child), policy):
                found.append(child)

    visit(root)
    return list({id(m): m for m in found}.values())


def _predicate(policy: Any) -> Callable[[nn.Module], Any]:
    if isinstance(policy, ModuleWrapPolicy):
        classes = tuple(policy._module_classes)
        return lambda m: isinstance(m, classes)
    if isinstance(policy, CustomPolicy):
        return policy._lambda_fn
    if isinstance(policy, functools.partial) and policy.func is transformer_auto_wrap_policy:
        classes = tuple(policy.keywords.get("transformer_layer_cls") or ())
        return lambda m: isinstance(m, classes)
    if isinstance(policy, functools.partial) and policy.func is lambda_auto_wrap_policy:
        fn = policy.keywords["lambda_fn"]
        return fn
    name = getattr(getattr(policy, "func", policy), "__name__", type(policy).__name__)
    raise SMPUnsupportedError(
        f"auto_wrap_policy={name} after tsm.init(): the FSDP façade honours transformer_auto_wrap_policy, "
        "lambda_auto_wrap_policy, ModuleWrapPolicy and CustomPolicy (use transformer_auto_wrap_policy on the "
        "decoder layer, as AWS's scripts do by default)."
    )


def _answer(value: Any, policy: Any) -> bool:
    if isinstance(value, dict):
        raise SMPUnsupportedError(
            f"{type(policy).__name__} returning per-module FSDP keyword arguments after tsm.init(): return True/False."
        )
    return bool(value)
