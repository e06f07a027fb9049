"""A tiny Hugging Face Mixtral through tsm.transform(config=MoEConfig(...)) and the scripts' FSDP call, and
its one-process reference: stock Mixtral on every data-parallel rank's batch, routed the same way
(``routing.route``), with the router losses added to the loss the reference backpropagates.

Under transformers 4.x the reference is 4.x's own Mixtral (per-expert ``block_sparse_moe.experts.{i}.w1/w2/w3``
modules); ``as_stacked`` writes its weights the way the transformed model holds them (5's stacks), with an
expression of its own, so a comparison does not go through smp_compat's name mapping."""

from __future__ import annotations

import copy
import types
from typing import Any

import fsdp_job
import torch
import torch.distributed as dist
from torch import nn

from smp_compat.v2.moe import routing
from smp_compat.v2.moe.moe_config import MoEConfig

EXPERTS, TOP_K = 4, 2
HF4 = int(__import__("transformers").__version__.split(".")[0]) < 5
BLOCK = "block_sparse_moe" if HF4 else "mlp"  # the decoder layer's MoE block


def tiny_mixtral(seed: int = 0) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=fsdp_job.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                        num_experts_per_tok=TOP_K, tie_word_embeddings=False, use_cache=False,
                        attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg)


def _routed_as(router: nn.Module, mode: str) -> None:
    """Make a stock MixtralTopKRouter select with ``mode`` (its logits and output format unchanged)."""

    def forward(self: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        weights, indices = routing.route(logits, self.top_k, mode, self.training)
        return logits, weights, indices

    router.forward = types.MethodType(forward, router)


def reference_loss(model: nn.Module, ids: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate: LM loss + every layer's router losses, the LM loss alone)."""
    out = model(input_ids=ids, attention_mask=None, labels=ids, output_router_logits=True)
    lm = out["loss"] - model.router_aux_loss_coef * out["aux_loss"]  # stock Mixtral's own aux term removed
    extra = torch.zeros(())
    for logits in out["router_logits"]:
        indices = routing.route(logits, TOP_K, cfg.moe_load_balancing, model.training)[1]
        if cfg.moe_load_balancing == "aux_loss":
            extra = extra + routing.aux_loss(logits, indices, cfg.moe_aux_loss_coeff)
        extra = extra + routing.z_loss(logits, cfg.moe_z_loss_coeff)
    return lm + extra, lm


def _optimizer(model: nn.Module, sgd: bool) -> torch.optim.Optimizer:
    """AdamW, or (``sgd``) SGD at lr 1: one step's weight change is then the clipped gradient itself."""
    return torch.optim.SGD(model.parameters(), lr=1.0) if sgd else fsdp_job.adamw(model)


def _routed_as_v4(block: nn.Module, mode: str) -> None:
    """transformers 4.x: the stock sparse-MoE block selecting with ``mode``, each expert its own 4.x module."""

    def forward(self: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden.reshape(-1, hidden.shape[-1])
        logits = self.gate(x)
        weights, indices = routing.route(logits, self.top_k, mode, self.training)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(indices == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None].to(x.dtype))
        return out.reshape(hidden.shape), logits

    block.forward = types.MethodType(forward, block)


def _routed_mixtral(cfg: MoEConfig) -> nn.Module:
    model = tiny_mixtral()
    for layer in model.model.layers:
        if HF4:
            _routed_as_v4(layer.block_sparse_moe, cfg.moe_load_balancing)
        else:
            _routed_as(layer.mlp.gate, cfg.moe_load_balancing)
    return model


def as_stacked(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict with every layer's experts as the transformed model holds them: 4.x's
    ``experts.{i}.w1/w3`` rows stacked into ``experts.gate_up_proj`` [E, 2I, H], ``w2`` into ``down_proj``
    [E, H, I]; a transformers 5 state dict is that already."""
    if not HF4:
        return dict(sd)
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for layer in {k.split(".experts.")[0] for k in sd if ".experts." in k}:
        w = {n: [sd[f"{layer}.experts.{i}.{n}.weight"] for i in range(EXPERTS)] for n in ("w1", "w2", "w3")}
        out[f"{layer}.experts.gate_up_proj"] = torch.stack([torch.cat(p) for p in zip(w["w1"], w["w3"])])
        out[f"{layer}.experts.down_proj"] = torch.stack(w["w2"])
    return out


def reference_sgd_16(dp: int, cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """One SGD step the way MixedPrecision(bf16, bf16, fp32 buffers) takes it: each data-parallel rank's
    forward and backward on a bf16 copy of the fp32 masters, bf16 gradients summed, divided by ``dp``, fp32."""
    master = _routed_mixtral(cfg)
    work = copy.deepcopy(master)
    for p in work.parameters():
        p.data = p.data.to(torch.bfloat16)
    grads = None
    for r in range(dp):
        work.zero_grad(set_to_none=True)
        reference_loss(work, fsdp_job.batch(0, r), cfg)[0].backward()
        mine = [p.grad for p in work.parameters()]
        grads = mine if grads is None else fsdp_job._add(grads, mine)
    for p, g in zip(master.parameters(), grads):
        p.grad = (g / dp).float()
    torch.nn.utils.clip_grad_norm_(master.parameters(), fsdp_job.CLIP)
    _optimizer(master, True).step()
    return {k: v.detach().clone() for k, v in master.state_dict().items()}


def reference_training(
    dp: int, cfg: MoEConfig, steps: int = fsdp_job.STEPS, sgd: bool = False
) -> tuple[list[float], dict]:  # fmt: skip
    model = _routed_mixtral(cfg)
    opt = _optimizer(model, sgd)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        pairs = [reference_loss(model, fsdp_job.batch(step, r), cfg) for r in range(dp)]
        (sum(p[0] for p in pairs) / dp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), fsdp_job.CLIP)
        opt.step()
        losses.append((sum(p[1] for p in pairs) / dp).item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def init_ep(ep: int, hybrid_shard_degree: int) -> None:
    import smp_compat.v2  # noqa: F401 - the torch.sagemaker finder
    import torch.sagemaker as tsm
    from smp_compat.v2.state import reset

    reset()
    tsm.init({"hybrid_shard_degree": hybrid_shard_degree, "expert_parallel_degree": ep})


def scripted_ep_training(
    cfg: MoEConfig, steps: int = fsdp_job.STEPS, mixed: Any = None, sgd: bool = False
) -> tuple[nn.Module, Any, list[float]]:  # fmt: skip
    """train_lib.py's path: transform(config=MoEConfig), FSDP with TransformerLayer, checkpointing, AdamW
    (``mixed``: FSDP's MixedPrecision; ``sgd``: SGD at lr 1 instead)."""
    import torch.sagemaker as tsm
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    model = tsm.transform(tiny_mixtral(), config=cfg)
    model = fsdp_job.wrap_as_scripts(model, strategy="hybrid_shard", mixed=mixed, layer=TransformerLayer)
    opt = _optimizer(model, sgd)
    losses = fsdp_job.train_steps(model, opt, dist.get_rank(), range(steps))
    return model, opt, losses


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered over its FSDP mesh, Hugging Face names; experts: this ep rank's rows only."""
    out = {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def expert_rows(name: str, ep: int, ep_rank: int, tensor: torch.Tensor) -> torch.Tensor:
    """The reference's rows of ``name`` that ep rank ``ep_rank`` holds."""
    if ".experts." not in name:
        return tensor
    per = tensor.shape[0] // ep
    return tensor[ep_rank * per : (ep_rank + 1) * per]


def full_load_round_trip(model: nn.Module) -> dict[str, torch.Tensor]:
    """Load a stock Mixtral's state dict (Hugging Face names of the installed transformers) into the wrapped
    ``model`` under FULL_STATE_DICT, as a fine-tuning start does, and give the full save that follows (rank 0)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(tiny_mixtral(seed=11).state_dict(), strict=True)
    return fsdp_job.full_params(model)
