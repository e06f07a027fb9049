"""``smp.state.module_manager``: the part of SMP >= 1.10's module manager that Hugging Face's code reads.

transformers' ``PreTrainedModel.save_pretrained`` (with SMP >= 1.10) runs the state dict through each
``smp_to_hf`` of ``smp.state.module_manager.translate_functions`` before writing it, so that a model whose
layers SMP swapped for its tensor-parallel ones is saved under Hugging Face's names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ModuleManager"]


class ModuleManager:
    """Reads the translation pairs off the process's DistributedModel each time (it may be made later)."""

    @property
    def translate_functions(self) -> list[tuple[Callable[..., Any], Callable[..., Any]]]:
        """``(smp_to_hf, hf_to_smp)`` per swapped model; empty without a DistributedModel or a swap."""
        from smp_compat.globalstate import state
        from smp_compat.nn.huggingface import translate_functions

        return [] if state.model is None else translate_functions(state.model.module)
