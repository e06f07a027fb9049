"""transformers 4.x's Mixtral layout under SMP's MoE layer: per-expert modules stacked on the way in, Hugging
Face 4.x names on the way out.

transformers 4.x (4.40 - 4.57) gives each decoder layer a ``block_sparse_moe``: the router ``gate`` (nn.Linear,
[E, H]) and ``experts``, a ModuleList of E ``MixtralBlockSparseTop2MLP`` with ``w1`` (gate) and ``w3`` (up),
[I, H] each, and ``w2`` (down), [H, I]. ``transform(config=MoEConfig(...))`` keeps the experts as transformers 5
stacks them (``LocalExperts``: ``gate_up_proj`` [n, 2I, H] = w1 rows then w3 rows, ``down_proj`` [n, H, I] = w2),
so expert parallelism, FSDP's expert mesh and sharded checkpoints are one code path for both majors. A full
state dict (FSDP's FULL_STATE_DICT through the façade, or ``model.state_dict()`` of an unwrapped model that holds
every expert) names them as 4.x does, ``block_sparse_moe.experts.{i}.w1.weight`` ..., so a full save loads into
stock transformers 4.x; loading such a state dict stacks them back.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["is_hf4_block", "stacked_experts", "to_hf4_names", "from_hf4_names", "install_name_hooks"]

# the block's own hooks see an activation-checkpoint wrapper's part, which the wrapper's hook removes later
_BLOCK = r"(?P<p>.*block_sparse_moe\.(?:_checkpoint_wrapped_module\.)?experts\.)"
_STACKED = re.compile(rf"^{_BLOCK}(?P<n>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(rf"^{_BLOCK}(?P<i>\d+)\.(?P<w>w[123])\.weight$")


def is_hf4_block(block: nn.Module | None) -> bool:
    """Whether ``block`` is transformers 4.x's MixtralSparseMoeBlock layout (a ModuleList of w1/w2/w3 experts)."""
    experts = getattr(block, "experts", None)
    return isinstance(experts, nn.ModuleList) and len(experts) > 0 and hasattr(experts[0], "w1")


def stacked_experts(block: nn.Module, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``lo`` to ``hi - 1`` of a 4.x block as (gate_up_proj [n, 2I, H], down_proj [n, H, I]); meta stays
    meta."""
    experts = block.experts
    gate_up = torch.stack([torch.cat([experts[i].w1.weight.detach(), experts[i].w3.weight.detach()], dim=0)
                           for i in range(lo, hi)])  # fmt: skip
    down = torch.stack([experts[i].w2.weight.detach() for i in range(lo, hi)])
    return gate_up, down


def _per_expert(prefix: str, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One stacked tensor as 4.x's per-expert entries (copies: a checkpoint writer refuses shared storage)."""
    if name == "down_proj":
        return [(f"{prefix}{i}.w2.weight", value[i].clone()) for i in range(value.shape[0])]
    inter = value.shape[1] // 2
    out = []
    for i in range(value.shape[0]):
        out.append((f"{prefix}{i}.w1.weight", value[i, :inter].clone()))
        out.append((f"{prefix}{i}.w3.weight", value[i, inter:].clone()))
    return out


def to_hf4_names(sd: dict[str, Any], prefix: str = "") -> None:
    """In place: every whole stacked expert tensor under ``prefix`` becomes 4.x's ``experts.{i}.w1/w2/w3.weight``
    entries, in 4.x's order (expert by expert: w1, w2, w3) where the stacked pair sat."""
    if not any(_STACKED.match(k) and k.startswith(prefix) for k in sd):
        return
    items = list(sd.items())
    sd.clear()
    for key, value in items:
        match = _STACKED.match(key)
        if match is None or not key.startswith(prefix) or not isinstance(value, torch.Tensor):
            sd[key] = value
            continue
        for name, piece in _per_expert(match["p"], match["n"], value):
            sd[name] = piece
    _order_as_hf4(sd)


def _order_as_hf4(sd: dict[str, Any]) -> None:
    """Per-expert keys in 4.x's module order (expert 0's w1, w2, w3, then expert 1's...), each block in place."""
    items = list(sd.items())
    sd.clear()
    pending: dict[str, list[tuple[str, Any]]] = {}
    for key, value in items:
        match = _PER_EXPERT.match(key)
        if match is None:
            _flush(sd, pending)
            sd[key] = value
        else:
            pending.setdefault(match["p"], []).append((key, value))
    _flush(sd, pending)


def _flush(sd: dict[str, Any], pending: dict[str, list[tuple[str, Any]]]) -> None:
    for entries in pending.values():
        for key, value in sorted(entries, key=_expert_order):
            sd[key] = value
    pending.clear()


def _expert_order(item: tuple[str, Any]) -> tuple[int, str]:
    match = _PER_EXPERT.match(item[0])
    return int(match["i"]), match["w"]  # type: ignore[index]


def from_hf4_names(sd: dict[str, Any], stacked_keys: set[str]) -> None:
    """In place: 4.x's per-expert entries become the stacked tensors named in ``stacked_keys`` (the model's
    own ``...block_sparse_moe.experts.gate_up_proj`` / ``down_proj``). A layer whose experts are not all
    there is left as it is, so a strict load names what is missing."""
    found: dict[str, dict[tuple[int, str], str]] = {}
    for key in sd:
        match = _PER_EXPERT.match(key)
        if match is not None and f"{match['p']}gate_up_proj" in stacked_keys:
            found.setdefault(match["p"], {})[(int(match["i"]), match["w"])] = key
    for prefix, keys in found.items():
        count = 1 + max(i for i, _ in keys)
        if set(keys) != {(i, w) for i in range(count) for w in ("w1", "w2", "w3")}:
            continue
        sd[f"{prefix}gate_up_proj"] = torch.stack([torch.cat([sd[keys[i, "w1"]], sd[keys[i, "w3"]]], dim=0)
                                                   for i in range(count)])  # fmt: skip
        sd[f"{prefix}down_proj"] = torch.stack([sd[keys[i, "w2"]] for i in range(count)])
        for key in keys.values():
            del sd[key]


def install_name_hooks(layer: nn.Module) -> None:
    """4.x names for an MoE layer's own ``state_dict`` / ``load_state_dict`` while it holds every expert as plain
    tensors (an unwrapped model at expert_parallel_degree 1); under FSDP the façade's full state dict does it."""
    layer._register_state_dict_hook(_after_state_dict)
    layer._register_load_state_dict_pre_hook(_before_load, with_module=True)


def _holds_every_expert(layer: nn.Module) -> bool:
    experts = layer.experts
    return experts.num_experts == experts.total and not any(isinstance(p, DTensor) for p in experts.parameters())


def _after_state_dict(layer: nn.Module, sd: dict[str, Any], prefix: str, _meta: Any) -> None:
    if _holds_every_expert(layer):
        to_hf4_names(sd, prefix)


def _before_load(layer: nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
    if _holds_every_expert(layer):
        from_hf4_names(sd, {f"{prefix}experts.gate_up_proj"})
