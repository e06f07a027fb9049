"""The forward inputs a Hugging Face swap cannot honour, refused by name under transformers 4.x and 5.x alike.

The swapped stacks compute a plain forward pass: no key/value cache, no per-layer outputs, no head mask. Stock
Hugging Face names these differently across versions (4.x ``past_key_values``; 5.x ``cache``, with
``past_key_values`` renamed to it by a decorator before the swap sees it) and 5.x hands models new keyword
arguments through ``**kwargs`` (flash-attention packing, ``cache_position``...). An input the swap would drop
is refused here rather than ignored: ignoring a cache makes ``generate()`` produce wrong text without an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smp_compat.errors import SMPUnsupportedError

__all__ = ["refuse_unsupported_inputs"]

_CACHES = ("past_key_values", "cache", "layer_past")
"""A key/value cache: transformers 4.x's name, 5.x's, and a layer's."""
_FLAGS = ("use_cache", "output_attentions", "output_hidden_states")
"""Refused when true: each asks for something the stack does not compute."""
_HARMLESS = {"return_dict", "num_items_in_batch", "token_type_ids", "position_ids", "encoder_attention_mask"}
"""Passed by stock Hugging Face in training and honoured (or meaningless) without a cache; kept as given."""


def refuse_unsupported_inputs(model: str, inputs: Mapping[str, Any], packed_positions: bool = False) -> None:
    """SMPUnsupportedError naming every input in ``inputs`` (the forward's keyword arguments) the swapped ``model``
    would not honour: a cache under any name, ``use_cache=True``, per-layer outputs, and any other argument set
    to something other than None / False (a head mask, cross-attention, ``cache_position``, 5.x's
    flash-attention packing arguments...). ``packed_positions``: also refuse ``position_ids`` that restart
    within a row while ``attention_mask`` is None, which transformers 5 reads as packed sequences and
    answers with a block-diagonal mask the swap does not build."""
    refused = []
    if any(inputs.get(name) is not None for name in _CACHES):
        refused.append("past_key_values / cache (KV cache; generate() needs it)")
    refused += [f"{name}=True" for name in _FLAGS if inputs.get(name)]
    known = set(_CACHES) | set(_FLAGS) | _HARMLESS | {"attention_mask"}
    refused += sorted(k for k, v in inputs.items() if k not in known and _set(v))
    if packed_positions and inputs.get("attention_mask") is None and _restarts(inputs.get("position_ids")):
        refused.append("position_ids that restart within a row (packed sequences) without an attention_mask")
    if refused:
        raise SMPUnsupportedError(
            f"{', '.join(refused)} in the tensor-parallel {model}: the swapped model computes a plain forward "
            "pass without a key/value cache (decode with the unswapped model, or pass use_cache=False)")  # fmt: skip


def _set(value: Any) -> bool:
    """Not None / False, nor a list of Nones (transformers 4 hands the encoder ``head_mask=[None] * layers``)."""
    if isinstance(value, (list, tuple)):
        return any(v is not None for v in value)
    return value is not None and value is not False


def _restarts(position_ids: torch.Tensor | None) -> bool:
    """Whether some row of ``position_ids`` does not count up by one (transformers 5's packed-sequence test)."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return False
    return bool((torch.diff(position_ids, dim=-1) != 1).any())
