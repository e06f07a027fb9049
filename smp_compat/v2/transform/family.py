"""A supported model family: how to find its decoder layers, and how each layer splits over the tp group.

Each family module (llama.py, mistral.py, gpt_neox.py) describes itself with one ``Family``; ``find_family``
picks the one whose ``model_type`` the model's Hugging Face config names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from smp_compat.errors import SMPUnsupportedError

__all__ = ["Family", "HeadCounts", "find_family", "SUPPORTED"]


@dataclass(frozen=True)
class HeadCounts:
    """A layer's attention shape: query heads, key/value heads (GQA), head size."""

    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Family:
    """What ``transform`` needs to know about one Hugging Face model family.

    ``colwise``/``rowwise``: submodule paths inside a decoder layer whose Linear output (resp. input) features
    are split over the tp group. ``attention``: the attention submodule's path; ``blocks``: the submodules
    (attention, MLP) whose input feeds several column-wise projections. ``head_attributes``: names of
    attention-module attributes that older transformers releases read in ``forward`` as head counts or widths,
    mapped to the local value they take (``heads``, ``kv_heads`` or ``width``: local heads times head size).
    """

    name: str
    model_types: tuple[str, ...]
    layers: Callable[[nn.Module], nn.ModuleList]
    heads: Callable[[Any], HeadCounts]
    intermediate: Callable[[Any], int]
    attention: str
    blocks: tuple[str, ...]
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    head_attributes: Mapping[str, str] = field(default_factory=dict)


def _families() -> list[Family]:
    from smp_compat.v2.transform import gpt_neox, llama, mistral

    return [gpt_neox.FAMILY, llama.FAMILY, mistral.FAMILY]


SUPPORTED = "GPT-NeoX, Llama (2, 3, 3.1) and Mistral"


def find_family(model: nn.Module) -> Family:
    """The family of a Hugging Face model (base or causal-LM); any other model: SMPUnsupportedError."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in _families():
        if model_type in family.model_types:
            return family
    seen = f"a Hugging Face {model_type!r} model" if model_type else f"{type(model).__name__} (not Hugging Face)"
    extra = (" Mixtral transforms with config=MoEConfig(...) (SMP's MoE layer, expert parallelism): "
             "transform(model, config=MoEConfig())." if model_type == "mixtral" else "")
    raise SMPUnsupportedError(
        f"torch.sagemaker.transform supports Hugging Face {SUPPORTED} models; got {seen}.{extra} "
        "Run other models without transform (plain FSDP through the script's own FullyShardedDataParallel call)."
    )


def base_model(model: nn.Module, prefix: str) -> nn.Module:
    """The base model under a causal-LM head (``model.model``, ``model.gpt_neox``), or the model itself."""
    inner = getattr(model, prefix, None)
    return inner if isinstance(inner, nn.Module) else model
