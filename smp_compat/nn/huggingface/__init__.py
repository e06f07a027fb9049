"""Hugging Face models with a built-in tensor-parallel version (``smp.nn.huggingface.<model>``).

Importing these never imports transformers; the swap registers itself only when a script uses it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from smp_compat.nn.huggingface import gpt2

__all__ = ["gpt2", "to_hf_format", "from_hf_translator"]

_HF_BLOCK = re.compile(r"(^|\.)h\.\d+\.")


def _has_swapped_gpt2(root: nn.Module) -> bool:
    return any(isinstance(m, gpt2.DistributedGPT2Model) for m in root.modules())


def to_hf_format(root: nn.Module, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``save_checkpoint(partial=False, translate_if_full=True)``: a swapped model's full dict in HF's format."""
    return gpt2.translate_state_dict_to_hf_gpt2(state_dict) if _has_swapped_gpt2(root) else state_dict


def from_hf_translator(root: nn.Module, state_dict: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Any] | None:
    """The translation a full HF checkpoint needs to load into a swapped model (SMP: "not required" for them)."""
    if _has_swapped_gpt2(root) and any(_HF_BLOCK.search(k) for k in state_dict):
        return gpt2.translate_hf_state_dict_to_smdistributed_gpt2
    return None
