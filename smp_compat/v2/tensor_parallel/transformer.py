"""``torch.sagemaker.tensor_parallel.transformer.TransformerLayer``: what the decoder layers of a transformed model are.

SMP's ``transform`` swaps each decoder layer for its own ``TransformerLayer``; AWS's scripts pass that class to
``transformer_auto_wrap_policy`` and to the activation-checkpointing ``check_fn``, both of which ask
``isinstance``. smp_compat keeps the Hugging Face layers (so state-dict keys stay Hugging Face's) and marks each
one it transformed; ``isinstance(layer, TransformerLayer)`` is true for exactly the marked layers, whatever
FSDP or a checkpoint wrapper later does to their class.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from smp_compat.errors import SMPUnsupportedError

__all__ = ["TETransformerLayer", "TransformerLayer", "mark_transformer_layer", "is_marked"]

_MARK = "_tsm_transformer_layer"


class _MarkedInstances(type(nn.Module)):  # type: ignore[misc]
    """The metaclass: instances of the class itself, and modules that ``transform`` marked, pass isinstance."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return super().__instancecheck__(obj) or (isinstance(obj, nn.Module) and is_marked(obj))


class TransformerLayer(nn.Module, metaclass=_MarkedInstances):
    """The decoder layers of a model returned by ``torch.sagemaker.transform`` are instances of this class.

    Not constructible: SMP builds it inside ``transform`` only, and so does smp_compat (by marking the model's
    own Hugging Face decoder layers).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise SMPUnsupportedError(
            "torch.sagemaker.tensor_parallel.transformer.TransformerLayer is not built directly: "
            "torch.sagemaker.transform(model) makes the model's decoder layers instances of it."
        )


def mark_transformer_layer(layer: nn.Module) -> None:
    """Make ``isinstance(layer, TransformerLayer)`` true (an instance attribute: copies and FSDP keep it)."""
    object.__setattr__(layer, _MARK, True)


def is_marked(module: nn.Module) -> bool:
    """Whether ``transform`` marked this module as a decoder layer."""
    return bool(module.__dict__.get(_MARK, False))


TETransformerLayer = TransformerLayer
"""SMP's name for the class on torch < 2.2 (AWS's fsdp_utils imports it there); the same class here."""
