"""The LM head of a swapped Hugging Face model is tied as ``config.tie_word_embeddings`` says, at the swap.

Hugging Face ties the output embedding to the input embedding inside ``PreTrainedModel.init_weights``. AWS's
SMP scripts replace ``init_weights`` by a no-op before building the model (SMP replaced the whole model by its
own, whose LM head was the embedding matrix), so the model reaches ``smp.DistributedModel`` untied. The swap
keeps Hugging Face's head and embedding modules, so it ties them itself with Hugging Face's own
``tie_weights()``, which reads the config (and nothing else of ``init_weights``).
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["tie_swapped_heads"]


def tie_swapped_heads(root: nn.Module, swapped: tuple[type, ...]) -> None:
    """``tie_weights()`` on each outermost transformers model under ``root`` that holds a module of a class in
    ``swapped``: its head becomes its embedding's weight where the config says to tie, else nothing changes."""
    modeling = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling, "PreTrainedModel", None)
    if pretrained is None:
        return

    def visit(module: nn.Module) -> None:
        if isinstance(module, pretrained):
            if any(isinstance(m, swapped) for m in module.modules()):
                module.tie_weights()
            return
        for child in module.children():
            visit(child)

    visit(root)
