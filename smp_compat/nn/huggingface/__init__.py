"""Hugging Face models with a built-in tensor-parallel version (``smp.nn.huggingface.<model>``).

Importing these never imports transformers; the swap registers itself only when a script uses it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from smp_compat.nn.huggingface import bert, gpt2, gptneo, roberta

__all__ = ["bert", "gpt2", "gptneo", "roberta", "to_hf_format", "from_hf_translator", "register_all"]

# swapped class -> (to HF, from HF, a key pattern only HF's layout has)
_TRANSLATORS = (
    (gpt2.DistributedGPT2Model, gpt2.translate_state_dict_to_hf_gpt2,
     gpt2.translate_hf_state_dict_to_smdistributed_gpt2, re.compile(r"(^|\.)h\.\d+\.")),
    (gptneo.DistributedGPTNeoModel, gptneo.translate_state_dict_to_hf_gptneo,
     gptneo.translate_hf_state_dict_to_smdistributed_gptneo, re.compile(r"(^|\.)h\.\d+\.")),
    (bert.DistributedBertEncoder, bert.translate_state_dict_to_hf_bert,
     bert.translate_hf_state_dict_to_smdistributed_bert, re.compile(r"(^|\.)encoder\.layer\.\d+\.")),
)  # fmt: skip


def register_all() -> None:
    """Register the built-in swaps of the Hugging Face models the installed transformers has."""
    gpt2.register()
    gptneo.register()
    bert.register()


def _swapped(root: nn.Module) -> list[tuple[Any, ...]]:
    return [t for t in _TRANSLATORS if any(isinstance(m, t[0]) for m in root.modules())]


def to_hf_format(root: nn.Module, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``save_checkpoint(partial=False, translate_if_full=True)``: a swapped model's full dict in HF's format."""
    for _, to_hf, _, _ in _swapped(root):
        state_dict = to_hf(state_dict)
    return state_dict


def from_hf_translator(root: nn.Module, state_dict: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], Any] | None:
    """The translation a full HF checkpoint needs to load into a swapped model (SMP: "not required" for them)."""
    for _, _, from_hf, hf_key in _swapped(root):
        if any(hf_key.search(k) for k in state_dict):
            return from_hf
    return None
