"""Hugging Face's initialization, run at ``smp.DistributedModel`` for a model whose script skipped it for SMP.

AWS's SMP v1 scripts replace ``PreTrainedModel.init_weights`` by a no-op before building a model that SMP
swaps (to start faster: their comment says ``DistributedModel`` overrides those weights): SMP replaced the
whole model by its own modules, which initialized themselves. smp_compat's swap
keeps Hugging Face's modules and weights (embeddings, final norm, head; each block's weights copied into
its shards), so under the no-op they would hold torch's construction defaults: an embedding's N(0, 1),
which through a tied head makes a first loss many times ln(vocab). So when a swap is about to happen and
the no-op is in place, Hugging Face's own initialization runs over it as ``post_init()`` would have run it
(tying is ``tying.tie_as_configured``'s): the model starts from Hugging Face's distributions (the draws come
in another order than a stock build's), and what ``from_pretrained`` loaded is kept (Hugging Face's own flags
skip it).

Parameters on the meta device (delayed initialization) are left alone: materializing replays
``_init_weights`` for them anyway (``memory/materialize.py``).
"""

from __future__ import annotations

import sys

from torch import nn

from smp_compat.nn.huggingface.tying import outermost_models

__all__ = ["initialize_if_skipped"]


def initialize_if_skipped(root: nn.Module) -> bool:
    """Run Hugging Face's weight initialization over each outermost transformers model under ``root`` if the
    script replaced ``PreTrainedModel.init_weights``; whether it ran."""
    modeling = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling, "PreTrainedModel", None)
    if pretrained is None or _is_transformers_own(pretrained.__dict__.get("init_weights")):
        return False
    ran = False
    for model in outermost_models(root):
        if any(p.is_meta for p in model.parameters()):
            continue
        _initialize(model)
        ran = True
    return ran


def _initialize(model: nn.Module) -> None:
    """What ``init_weights`` runs before tying, through the entry points the scripts leave alone: transformers 5's
    ``initialize_weights()``, else (4.x) ``apply(_initialize_weights)``. Both skip what ``from_pretrained`` loaded."""
    initialize = getattr(model, "initialize_weights", None)
    if callable(initialize):
        initialize()
    else:
        model.apply(model._initialize_weights)


def _is_transformers_own(function: object) -> bool:
    """Whether ``function`` is transformers' own (not a script's replacement such as ``lambda x: None``)."""
    module = getattr(function, "__module__", None) or ""
    return module == "transformers" or module.startswith("transformers.")
