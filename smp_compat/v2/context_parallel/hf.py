"""Context parallelism for a Hugging Face decoder: the three things a cp rank's model must do differently.

``enable`` (called by ``tsm.transform`` when ``context_parallel_degree > 1``) wires them into the model, names
and modules kept:

* positions: a forward pre-hook on the base model gives rotary embeddings the chunks' true positions when
  the script passes no ``position_ids`` (AWS's scripts pass none);
* attention: an attention implementation registered with Hugging Face's ``AttentionInterface`` (transformers
  >= 4.48) runs causal attention over the whole sequence (attention.py) with the model's scaling, after the
  model's own projections and rotary embedding, on the rank's local heads under tensor parallelism;
* loss: when ``labels`` are given, the causal-LM head's loss is computed in the whole sequence (loss.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.v2.context_parallel.attention import CpGroup, context_parallel_attention
from smp_compat.v2.context_parallel.chunks import local_positions
from smp_compat.v2.context_parallel.loss import global_shift_loss

__all__ = ["ATTN_IMPLEMENTATION", "enable"]

ATTN_IMPLEMENTATION = "smp_context_parallel"
_PLAN = "_smp_context_parallel"


def enable(model: nn.Module, base: nn.Module, attentions: list[nn.Module], group: dist.ProcessGroup,
           comm_type: str) -> None:  # fmt: skip
    """Make ``model`` (a causal LM or its ``base`` model) run one cp rank's share of the whole sequence."""
    _refuse(model.config)
    _register()
    cp = CpGroup.of(group, comm_type)
    for attention in attentions:
        attention.__dict__[_PLAN] = cp
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    base.register_forward_pre_hook(lambda m, a, k: _positions(cp, a, k), with_kwargs=True)
    if base is not model:
        pending: dict[str, torch.Tensor] = {}
        model.register_forward_pre_hook(lambda m, a, k: _take_labels(pending, a, k), with_kwargs=True)
        model.register_forward_hook(lambda m, a, k, out: _add_loss(pending, cp, out), with_kwargs=True)


def _refuse(config: Any) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise SMPUnsupportedError(
            f"torch.sagemaker.transform: context parallelism with a sliding attention window ({config.model_type} "
            f"sliding_window={window}) is not supported, as in SMP v2; set config.sliding_window = None (the same "
            "model when sequences are no longer than the window) or context_parallel_degree to 1."
        )
    if getattr(config, "attention_dropout", 0.0):
        raise SMPUnsupportedError(
            f"torch.sagemaker.transform: context parallelism with attention dropout (attention_dropout="
            f"{config.attention_dropout}) is not supported; set it to 0.0 (the default of the supported models)."
        )


def _register() -> None:
    try:
        from transformers import AttentionInterface
    except ImportError:
        import transformers

        raise SMPUnsupportedError(
            f"torch.sagemaker.transform: context parallelism needs Hugging Face's AttentionInterface (transformers "
            f">= 4.48); this is transformers {transformers.__version__}. Upgrade transformers or set "
            "context_parallel_degree to 1."
        ) from None
    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Hugging Face's attention-function signature: (B, H, S, D) in, (B, S, H, D) and no weights out."""
    cp = module.__dict__.get(_PLAN)
    if cp is None:
        raise SMPConfigError(f"{type(module).__name__} has no context-parallel group; run it through tsm.transform.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = context_parallel_attention(query, key, value, scale, cp)
    return out.transpose(1, 2).contiguous(), None


def _positions(cp: CpGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The chunks' true positions as ``position_ids``; a padding mask is refused (the mask is causal only)."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise SMPUnsupportedError(
            "context parallelism with a padding attention_mask: the attention is causal over the whole sequence "
            "only; pass attention_mask=None (as AWS's scripts do) with unpadded sequences."
        )
    positions = local_positions(cp.size, cp.rank, tokens.shape[1], tokens.device).unsqueeze(0)
    given = kwargs.get("position_ids")
    if given is not None and not torch.equal(given.to(positions.device).expand(tokens.shape[0], -1),
                                             positions.expand(tokens.shape[0], -1)):  # fmt: skip
        raise SMPUnsupportedError(
            "context parallelism: position_ids other than the local chunks' true positions (packed sequences?) "
            "are not supported; pass position_ids=None and the model uses the head/tail chunks' positions."
        )
    return args, {**kwargs, "position_ids": positions.expand(tokens.shape[0], -1), "attention_mask": None}


def _take_labels(pending: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Keep ``labels`` for the whole-sequence loss and run the model without Hugging Face's local loss."""
    pending.clear()
    labels = kwargs.get("labels")
    if labels is None:
        return None
    pending["labels"] = labels
    return args, {**kwargs, "labels": None}


def _add_loss(pending: dict[str, torch.Tensor], cp: CpGroup, output: Any) -> Any:
    labels = pending.pop("labels", None)
    if labels is None:
        return None
    logits = output["logits"] if isinstance(output, dict) else output[0]
    loss = global_shift_loss(logits, labels, cp.group)
    if isinstance(output, dict):  # a ModelOutput: rebuilt so that "loss" comes first, as Hugging Face orders it
        return type(output)(loss=loss, **{k: v for k, v in output.items() if k != "loss"})
    return (loss, *output)
