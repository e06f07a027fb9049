"""Every Hugging Face model reaches ``smp.DistributedModel`` tied as its config says.

Hugging Face ties weights (the LM head to the input embedding where ``config.tie_word_embeddings`` says so;
in transformers 5 also T5's encoder and decoder ``embed_tokens`` to ``shared``) inside
``PreTrainedModel.init_weights``. AWS's SMP scripts replace ``init_weights`` by a no-op before building the
model (SMP replaced the model by its own, whose LM head was the embedding matrix, and transformers 4 passed
T5's embedding to both stacks), so the model would arrive untied and train two or three copies of one
matrix. ``DistributedModel`` therefore calls Hugging Face's own ``tie_weights()``, which reads the config and
nothing else of ``init_weights``, on each outermost transformers model, swapped or not. A model that is
already tied is left as it is.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from torch import nn

__all__ = ["outermost_models", "tie_as_configured"]


def tie_as_configured(root: nn.Module) -> None:
    """``tie_weights()`` on each outermost transformers ``PreTrainedModel`` under ``root`` (``root`` included)."""
    for model in outermost_models(root):
        model.tie_weights()


def outermost_models(root: nn.Module) -> Iterator[nn.Module]:
    """Each outermost transformers ``PreTrainedModel`` under ``root`` (``root`` included); none before
    transformers is imported."""
    modeling = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling, "PreTrainedModel", None)
    if pretrained is None:
        return

    def visit(module: nn.Module) -> Iterator[nn.Module]:
        if isinstance(module, pretrained):
            yield module
            return
        for child in module.children():
            yield from visit(child)

    yield from visit(root)
