"""``transform(model, config=MoEConfig(...))`` for Mixtral: each decoder layer's sparse-MoE block becomes a
:class:`MoELayer` holding this rank's share of the experts, Hugging Face names kept.

Hugging Face transformers 5 stores a layer's experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) next to the router ``mlp.gate.weight`` [E, H]; the ep rank keeps rows
``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of both stacks (meta stays meta). transformers 4.x's per-expert
``block_sparse_moe.experts.{i}.w1/w2/w3`` are stacked the same way (hf4.py), the block keeps its 4.x name and
its ``(hidden_states, router_logits)`` output, and full state dicts carry 4.x's per-expert names.
"""

from __future__ import annotations

from torch import nn

from smp_compat.errors import SMPConfigError, SMPUnsupportedError
from smp_compat.v2.moe import hf4
from smp_compat.v2.moe.ep import ep_group
from smp_compat.v2.moe.moe_config import MoEConfig
from smp_compat.v2.moe.moe_layer import LocalExperts, MoELayer

__all__ = ["moe_transform"]


def moe_transform(model: nn.Module, config: MoEConfig, world: int, rank: int, dp_rank: int, ep: int) -> list[nn.Module]:
    """Swap every Mixtral MoE block of ``model`` for a MoELayer; returns the decoder layers."""
    if not isinstance(config, MoEConfig):
        raise SMPConfigError(f"torch.sagemaker.transform(config=...) takes a MoEConfig; got {type(config).__name__}.")
    hf = getattr(model, "config", None)
    if getattr(hf, "model_type", None) != "mixtral":
        raise SMPUnsupportedError(
            "torch.sagemaker.transform(config=MoEConfig(...)): SMP v2's mixture-of-experts support covers Hugging "
            f"Face Mixtral; got {getattr(hf, 'model_type', type(model).__name__)!r}."
        )
    if not config.smp_moe:
        raise SMPUnsupportedError("MoEConfig(smp_moe=False): only SMP's MoE implementation is provided.")
    experts = hf.num_local_experts
    if experts % ep:
        raise SMPConfigError(
            f"expert_parallel_degree ({ep}) must divide the experts per layer (num_local_experts={experts})."
        )
    layers = getattr(getattr(model, "model", model), "layers")
    group = ep_group(world, rank, ep) if ep > 1 else None
    for layer in layers:
        attribute, block = _hf_block(layer)
        setattr(layer, attribute, _convert_block(block, hf, config, group, dp_rank % ep, ep))
    return list(layers)


def _hf_block(layer: nn.Module) -> tuple[str, nn.Module]:
    """(attribute, block): transformers 5's ``mlp`` with stacked experts, or 4.x's ``block_sparse_moe``."""
    block = getattr(layer, "mlp", None)
    if getattr(getattr(block, "experts", None), "gate_up_proj", None) is not None:
        return "mlp", block  # type: ignore[return-value]
    block = getattr(layer, "block_sparse_moe", None)
    if hf4.is_hf4_block(block):
        return "block_sparse_moe", block  # type: ignore[return-value]
    raise SMPUnsupportedError(
        "torch.sagemaker.transform(config=MoEConfig(...)) needs Hugging Face Mixtral's sparse-MoE block "
        "(transformers 5's mlp with stacked experts, or 4.x's block_sparse_moe with experts.{i}.w1/w2/w3); this "
        f"decoder layer has {type(getattr(layer, 'mlp', block)).__name__}."
    )


def _convert_block(block: nn.Module, hf: object, config: MoEConfig, group: object, ep_rank: int, ep: int) -> MoELayer:
    v4 = hf4.is_hf4_block(block)
    total = len(block.experts) if v4 else block.experts.gate_up_proj.shape[0]
    per = total // ep
    lo, hi = ep_rank * per, (ep_rank + 1) * per
    if v4:
        gate_up, down = hf4.stacked_experts(block, lo, hi)
        act_fn = block.experts[0].act_fn
    else:
        gate_up = block.experts.gate_up_proj.detach()[lo:hi].clone()
        down = block.experts.down_proj.detach()[lo:hi].clone()
        act_fn = block.experts.act_fn
    local = LocalExperts(gate_up, down, act_fn, first=lo, init_std=getattr(hf, "initializer_range", 0.02), total=total)
    layer = MoELayer(block.gate, local, hf.num_experts_per_tok, total, config, group, ep,  # type: ignore[attr-defined]
                     getattr(hf, "router_jitter_noise", 0.0) or 0.0, returns_router_logits=v4)  # fmt: skip
    if v4:
        hf4.install_name_hooks(layer)
    return layer


def _holds_moe_layer(layer: nn.Module) -> bool:
    return any(isinstance(getattr(layer, name, None), MoELayer) for name in ("mlp", "block_sparse_moe"))


def transform_moe(model: nn.Module, config: object, device: object, dtype: object, from_rank0: bool,
                  move: object) -> nn.Module:  # fmt: skip
    """``transform``'s MoE path: checks against ``tsm.state``, then :func:`moe_transform`, layers marked."""
    from smp_compat.errors import SMPNotInitializedError
    from smp_compat.v2.state import state
    from smp_compat.v2.tensor_parallel.transformer import mark_transformer_layer

    if not state.initialized:
        raise SMPNotInitializedError("torch.sagemaker.transform needs torch.sagemaker.init() first.")
    ep, tp = state.expert_parallel_degree, state.tensor_parallel_degree
    if (tp > 1 and ep > 1) or state.context_parallel_degree > 1:
        raise SMPUnsupportedError(
            f"torch.sagemaker.transform(config=MoEConfig(...)) with tensor_parallel_degree ({tp}) and "
            f"expert_parallel_degree ({ep}) both > 1, or context_parallel_degree "
            f"({state.context_parallel_degree}) > 1: SMP v2 refuses expert parallelism with tensor parallelism, "
            "and smp_compat runs Mixtral's MoE layer without context parallelism. Use one of ep or tp."
        )
    if from_rank0 and ep > 1:
        raise SMPUnsupportedError(
            "transform(config=MoEConfig(...), load_state_dict_from_rank0=True) with expert_parallel_degree > 1: "
            "rank 0 holds only its own experts after the split; load the checkpoint on every rank instead."
        )
    decoder = getattr(getattr(model, "model", model), "layers", None)
    if decoder is not None and len(decoder) and all(_holds_moe_layer(layer) for layer in decoder):
        return model  # transformed already (as tensor_parallelize: a second call changes nothing)
    if tp > 1:  # attention split over tp first (its own broadcast within the tp group); experts stay whole
        from smp_compat.v2.transform.api import tensor_parallelize

        tensor_parallelize(model, state.device_mesh["tp"], device, dtype, from_rank0)
    move(model, device, dtype)  # type: ignore[operator]
    layers = moe_transform(model, config, state.world_size, state.rank, state.dp_rank, ep)  # type: ignore[arg-type]
    for layer in layers:
        mark_transformer_layer(layer)
    return model
