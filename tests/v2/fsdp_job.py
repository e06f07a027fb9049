"""The v2 scripts' FSDP call sequence on a tiny Hugging Face model, and its one-process reference.

``scripted_training`` does what AWS's train_lib.py does after ``tsm.init()``: ``FullyShardedDataParallel``
with the decoder-layer auto-wrap policy, ``MixedPrecision``, ``sharding_strategy``, ``device_id``,
``use_orig_params``, prefetch flags; REENTRANT activation checkpointing, ``offload_wrapper``, AdamW with
two parameter groups, ``clip_grad_norm_``. ``reference_training`` trains the same model in one process
with plain PyTorch on every data-parallel rank's batch (the mean of their losses, as FSDP averages).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, SEQ, BATCH, STEPS, CLIP = 64, 16, 2, 5, 1.0


def tiny_llama(seed: int = 0, meta: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False,
                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(seed)
    if meta:
        with parameters_on_meta():
            return LlamaForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """What the scripts' ``accelerate.init_empty_weights()`` does: parameters on meta, buffers real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def decoder_layer() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The scripts' two groups: no weight decay for norms and biases."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    decay, no_decay = [], []
    for m in model.modules():
        for n, p in m._parameters.items():
            if p is not None:
                (no_decay if isinstance(m, LlamaRMSNorm) or n == "bias" else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=1e-2, weight_decay=0.1)


@functools.cache
def reference_training(dp: int, steps: int = STEPS) -> tuple[list[float], dict]:
    """One process: each step the mean loss over the ``dp`` ranks' batches, global-norm clipping, AdamW."""
    model = tiny_llama()
    opt = adamw(model)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = sum(_loss(model, batch(step, r)) for r in range(dp)) / dp
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(total.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def reference_training_16(
    dp: int, shard: int, dtype: torch.dtype, steps: int = STEPS,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
) -> tuple[list[float], dict]:  # fmt: skip
    """One process doing what MixedPrecision(dtype, dtype, fp32 buffers) does: fp32 masters and optimizer,
    forward and backward in ``dtype`` per data-parallel rank, gradients summed in ``dtype`` within each shard
    group, then across replicas (HSDP's reduce-scatter, then all-reduce), divided by ``dp``, then fp32."""
    import copy

    master = tiny_llama()
    opt = (make_opt or adamw)(master)
    losses = []
    for step in range(steps):
        work = copy.deepcopy(master)
        for p in work.parameters():
            p.data = p.data.to(dtype)
        per_rank, step_losses = [], []
        for r in range(dp):
            work.zero_grad(set_to_none=True)
            loss = _loss(work, batch(step, r))
            loss.backward()
            step_losses.append(loss.float().item())
            per_rank.append([p.grad for p in work.parameters()])
        groups = [functools.reduce(_add, per_rank[g : g + shard]) for g in range(0, dp, shard)]
        for p, g in zip(master.parameters(), functools.reduce(_add, groups)):
            p.grad = (g / dp).float()
        torch.nn.utils.clip_grad_norm_(master.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / dp)
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def _add(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x + y for x, y in zip(a, b)]


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=None, labels=ids)["loss"]


def wrap_as_scripts(
    model: nn.Module,
    strategy: str = "hybrid_shard",
    mixed: Any = None,
    layer: type | None = None,
    **extra: Any,
) -> nn.Module:
    """train_lib.py's FSDP(...) call, activation checkpointing and offload_wrapper (``layer``: the decoder
    layer class; the scripts pass SMP's TransformerLayer after ``tsm.transform``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
        offload_wrapper,
    )
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    layer = layer or decoder_layer()
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer}),
        mixed_precision=mixed,
        sharding_strategy=getattr(ShardingStrategy, strategy.upper()),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        limit_all_gathers=True,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        **extra,
    )
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT, checkpoint_fn=None)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, layer))
    return offload_wrapper(model)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, dp_rank: int, steps: range) -> list[float]:
    """The scripts' step; returns the mean loss over the data-parallel ranks of each step."""
    from smp_compat.v2.grad_norm import clip_grad_norm_

    losses = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=batch(step, dp_rank), attention_mask=None, labels=batch(step, dp_rank))["loss"]
        loss.backward()
        clip_grad_norm_(model, CLIP)
        opt.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    return (stacked / dist.get_world_size()).tolist()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The scripts' final full save: FULL_STATE_DICT(rank0_only, offload_to_cpu); {} on other ranks."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cfg = FullStateDictConfig(rank0_only=True, offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        return {k: v.clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def init_v2(hybrid_shard_degree: int, tp: int = 1, local_world_size: int | None = None) -> None:
    """``tsm.init`` as a fresh job would run it (a second call in one test process starts over)."""
    import os

    import smp_compat.v2  # noqa: F401 - installs the torch.sagemaker finder, as `smp-compat run` does
    import torch.sagemaker as tsm
    from smp_compat.v2.state import reset

    reset()
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    tsm.init({"hybrid_shard_degree": hybrid_shard_degree, "tensor_parallel_degree": tp})
