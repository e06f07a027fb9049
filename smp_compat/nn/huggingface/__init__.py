"""Hugging Face models with a built-in tensor-parallel version (``smp.nn.huggingface.<model>``).

Importing these never imports transformers; the swap registers itself only when a script uses it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from smp_compat.nn.huggingface import bert, gpt2, gptj, gptneo, gptneox, roberta

__all__ = ["bert", "gpt2", "gptj", "gptneo", "gptneox", "roberta", "to_hf_format", "from_hf_translator", "register_all",
           "translate_functions"]

# swapped class -> (to HF, from HF, a key pattern only HF's layout has)
_TRANSLATORS = (
    (gpt2.DistributedGPT2Model, gpt2.translate_state_dict_to_hf_gpt2,
     gpt2.translate_hf_state_dict_to_smdistributed_gpt2, re.compile(r"(^|\.)h\.\d+\.")),
    (gptneo.DistributedGPTNeoModel, gptneo.translate_state_dict_to_hf_gptneo,
     gptneo.translate_hf_state_dict_to_smdistributed_gptneo, re.compile(r"(^|\.)h\.\d+\.")),
    (gptj.DistributedGPTJModel, gptj.translate_state_dict_to_hf_gptj,
     gptj.translate_hf_gptj_state_dict_to_smdistributed_gptj, re.compile(r"(^|\.)h\.\d+\.")),
    (gptneox.DistributedGPTNeoXModel, gptneox.translate_state_dict_to_hf_gptneox,
     gptneox.translate_hf_state_dict_to_smdistributed_gptneox, re.compile(r"(^|\.)layers\.\d+\.")),
    (bert.DistributedBertEncoder, bert.translate_state_dict_to_hf_bert,
     bert.translate_hf_state_dict_to_smdistributed_bert, re.compile(r"(^|\.)encoder\.layer\.\d+\.")),
)  # fmt: skip


def register_all() -> None:
    """Register the built-in swaps of the Hugging Face models the installed transformers has."""
    gpt2.register()
    gptneo.register()
    gptj.register()
    gptneox.register()
    bert.register()


def _swapped(root: nn.Module) -> list[tuple[Any, ...]]:
    found = []
    for cls, to_hf, from_hf, hf_key in _TRANSLATORS:
        module = next((m for m in root.modules() if isinstance(m, cls)), None)
        if isinstance(module, gptneox.DistributedGPTNeoXModel):  # its fused q|k|v layout needs the head count
            heads = module.config.num_attention_heads
            to_hf = functools.partial(to_hf, num_attention_heads=heads)
            from_hf = functools.partial(from_hf, num_attention_heads=heads)
        if module is not None:
            found.append((cls, to_hf, from_hf, hf_key))
    return found


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


def translate_functions(root: nn.Module) -> list[tuple[Callable[..., Any], Callable[..., Any]]]:
    """``(smp_to_hf, hf_to_smp)`` for each swapped Hugging Face model under ``root``, as SMP >= 1.10's
    ``smp.state.module_manager.translate_functions`` lists them; empty where no module was swapped (the
    model's own names are Hugging Face's, so nothing needs translating)."""
    return [(to_hf, from_hf) for _, to_hf, from_hf, _ in _swapped(root)]
