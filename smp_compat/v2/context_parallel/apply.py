"""``tsm.transform``'s context-parallel step: find the model's base and attention modules, then wire cp in."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from smp_compat.errors import SMPConfigError
from smp_compat.v2.context_parallel import hf
from smp_compat.v2.transform.family import find_family

__all__ = ["context_parallelize"]


def context_parallelize(model: nn.Module, group: dist.ProcessGroup, comm_type: str) -> nn.Module:
    """Run ``model`` (GPT-NeoX, Llama or Mistral, causal LM or base) as one rank of the cp ``group``."""
    family = find_family(model)
    layers = family.layers(model)
    base = next((m for m in model.modules() if getattr(m, "layers", None) is layers), None)
    if base is None:
        raise SMPConfigError(f"torch.sagemaker.transform: {family.name}'s decoder layers have no parent model")
    attentions = [layer.get_submodule(family.attention) for layer in layers]
    hf.enable(model, base, attentions, group, comm_type)
    return model
