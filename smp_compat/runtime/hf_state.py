"""Hugging Face state outside tensors, across pipeline ranks: captured outputs and KV caches.

transformers 5 collects ``output_attentions`` (and other recorded outputs: cross-attentions, router logits,
hidden states of inner layers) with forward hooks on inner modules. They append to a collector that the
model's top-level forward puts in a context variable. A module served on another rank ran those hooks with
no collector there, so e.g. the attentions of the layers on pp_rank 1 were silently missing. Now a remote
call carries what the caller collects (and how many entries it has); the owner collects the same during the
call and returns the new entries with the result, and the caller appends them to its own collector, in
call order. Without transformers, or with nothing being collected, nothing travels.

A KV cache (``transformers.Cache``) is changed in place by every layer; the owner of a layer updates its
own copy, which does not come back, so a filled cache passed to a pipelined model is refused.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from smp_compat.errors import SMPUnsupportedError

__all__ = ["request", "collecting", "new_entries", "merge", "refuse_filled_cache"]

_MODULE = "transformers.utils.output_capturing"


def _collector_var() -> Any:
    module = sys.modules.get(_MODULE)
    return getattr(module, "_active_collector", None)


def request(root: nn.Module) -> dict[str, Any] | None:
    """Caller side: what the active collector gathers ({key: entries so far}; settings, the ``_``-keys, as they
    are) and which models under ``root`` have their capture hooks installed (the owner installs the same)."""
    var = _collector_var()
    collector = var.get() if var is not None else None
    if not collector:
        return None
    hooked = [name for name, m in root.named_modules() if getattr(m, "_output_capturing_hooks_installed", False)]
    return {"collect": {k: v if k.startswith("_") else len(v) for k, v in collector.items()}, "hooked": hooked}


@contextlib.contextmanager
def collecting(requested: dict[str, Any] | None, root: nn.Module) -> Iterator[dict[str, Any] | None]:
    """Owner side, around a served call: the caller's hooks, and a collector like the caller's (placeholders for
    the entries it has, so hooks that count them, such as the selection of hidden states, count the same)."""
    var = _collector_var()
    if not requested or var is None:
        yield None
        return
    for name in requested["hooked"]:  # transformers installs them lazily, where the top-level forward runs
        sys.modules[_MODULE].maybe_install_capturing_hooks(root.get_submodule(name))
    wanted = requested["collect"]
    collector = {k: v if k.startswith("_") else [None] * v for k, v in wanted.items()}
    token = var.set(collector)
    try:
        yield collector
    finally:
        var.reset(token)


def new_entries(requested: dict[str, Any], collector: dict[str, Any]) -> dict[str, list[Any]]:
    """What the served call added, per key."""
    return {k: collector[k][n:] for k, n in requested["collect"].items() if not k.startswith("_")}


def merge(entries: dict[str, list[Any]]) -> None:
    """Caller side, after the reply: append the owner's entries to the active collector."""
    var = _collector_var()
    collector = var.get() if var is not None else None
    if collector is None:
        return
    for key, items in entries.items():
        collector[key].extend(items)


def refuse_filled_cache(args: tuple, kwargs: dict) -> None:
    """The model's own call at pp > 1: a KV cache that already holds keys and values (decoding) is refused;
    the layers of other pipeline ranks would attend to stale or missing entries. An empty cache (training
    with ``use_cache``) is fine: nothing reads it back."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    filled = _legacy_filled(kwargs.get("past_key_values"))
    if cache_type is not None:
        filled = filled or any(isinstance(v, cache_type) and v.get_seq_length() > 0 for v in (*args, *kwargs.values()))
    if filled:
        raise SMPUnsupportedError(
            "past_key_values holding cached keys and values with pipeline_parallel_degree > 1: each pipeline "
            "rank updates the cache of its own layers in place and those updates do not come back, so "
            "decoding would attend to missing entries. Decode without a cache (use_cache=False), or at pp = 1."
        )


def _legacy_filled(value: Any, depth: int = 0) -> bool:
    """transformers 4.x's tuple cache (per layer a ``(key, value)`` pair of ``[N, heads, S, d]`` tensors, or one
    layer's pair) that holds keys and values."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 4 and value.shape[-2] > 0
    return depth < 2 and isinstance(value, (tuple, list)) and any(_legacy_filled(v, depth + 1) for v in value)
