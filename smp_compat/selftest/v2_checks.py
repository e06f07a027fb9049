"""The battery's SMP v2 checks: a tiny Hugging Face Llama trained the way AWS's v2 scripts train it (``tsm.init``,
``tsm.transform``, the script's own ``FullyShardedDataParallel`` call with hybrid sharding), held against
one-process PyTorch; and a sharded (DCP) checkpoint resumed in a fresh ``tsm.init``.

Each check initializes SMP v2 on the job's process group and resets it afterwards, as the v1 checks do with
``smp.init`` / ``smp.reset``. FSDP (v1's sdp too) needs NCCL on GPUs; transformers must be installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp_compat.selftest.checks import Context, Result, Skipped, shared_folder
from smp_compat.selftest.faults import Injector
from smp_compat.selftest.models import Recipe, llama_recipe, mixtral_recipe
from smp_compat.selftest.training import Tracker, reference_run

__all__ = ["context_parallel", "expert_parallel", "hybrid_shard", "sharded_resume", "tp_hybrid_shard", "user_config"]

SAMPLES_PER_DP_RANK = 2


def _require(ctx: Context, multiple: int, what: str) -> None:
    if ctx.env.world_size % multiple:
        raise Skipped(f"{what} needs a multiple of {multiple} ranks; this job has {ctx.env.world_size}")
    lacking = [i.rank for i in ctx.env.ranks if i.versions.get("transformers") is None]
    if lacking:
        raise Skipped(f"transformers is not installed (ranks {lacking})")
    if ctx.device.type == "cuda" and ctx.env.backend != "nccl":
        raise Skipped("FSDP2 on GPUs needs NCCL, and ranks here share a GPU (gloo)")


@contextmanager
def _v2(params: dict[str, Any]) -> Iterator[Any]:
    """``tsm.init(params)`` on the job's process group for the block; SMP v2's state is reset after it."""
    import smp_compat.v2 as tsm
    from smp_compat.v2.state import reset

    reset()
    tsm.init(params)
    try:
        yield tsm
    finally:
        reset()


def _seeded(recipe: Recipe, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return recipe.build()


def _wrap(tsm: Any, model: nn.Module, device: torch.device, **transform: Any) -> nn.Module:
    """The scripts' sequence: ``transform(model, **transform)``, then ``FullyShardedDataParallel`` wrapping each
    decoder layer."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from smp_compat.v2.tensor_parallel.transformer import TransformerLayer

    model = tsm.transform(model, **(transform or {"cp_comm_type": "p2p"}))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                                    use_orig_params=True, device_id=device)  # fmt: skip


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole on every rank (a collective), as the one-process model's state dict names it."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    config = FullStateDictConfig(rank0_only=False, offload_to_cpu=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu() for k, v in state.items()}


def _train(tsm: Any, recipe: Recipe, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device,
           steps: range, observe: Callable[[int, float], None]) -> None:  # fmt: skip
    """AWS's step: this data-parallel rank's samples (tp peers share them; cp peers take their head and tail
    chunks of them), backward, step; the mean loss."""
    from smp_compat.v2.context_parallel import split_for_cp_rank

    state = tsm.state
    data = recipe.batches(SAMPLES_PER_DP_RANK * state.dp_size)
    for index in steps:
        opt.zero_grad(set_to_none=True)
        mine = [t[state.dp_rank * SAMPLES_PER_DP_RANK : (state.dp_rank + 1) * SAMPLES_PER_DP_RANK] for t in data[index]]
        if state.cp_size > 1:
            mine = [split_for_cp_rank(t, state.cp_size, state.cp_rank) for t in mine]
        loss = recipe.loss(model, *(t.to(device) for t in mine))
        loss.backward()
        opt.step()
        total = loss.detach().float().reshape(1).cpu() if device.type == "cpu" else loss.detach().float().reshape(1)
        dist.all_reduce(total)  # tp peers hold the same loss, cp peers shares of it whose mean is the dp rank's
        observe(index, total.item() / dist.get_world_size())


def _layout(tsm: Any) -> str:
    layout = tsm.state.layout
    parts = ([f"tp{layout.tp}"] if layout.tp > 1 else []) + ([f"cp{layout.cp}"] if layout.cp > 1 else [])
    parts += [f"ep{layout.ep}"] if layout.ep > 1 else []
    return "×".join([*parts, f"shard{layout.shard}", f"rep{layout.rep}"])


def _run(ctx: Context, params: dict[str, Any], recipe: Recipe | None = None, **transform: Any) -> Result:
    recipe, tol = recipe or llama_recipe(), ctx.fp32
    dp = ctx.env.world_size // (params.get("tensor_parallel_degree", 1) * params.get("context_parallel_degree", 1))
    tracker = Tracker(reference_run(recipe, SAMPLES_PER_DP_RANK * dp, ctx.device), tol)
    with _v2(params) as tsm:
        model = _wrap(tsm, _seeded(recipe, 0), ctx.device, **transform)
        opt = recipe.optimizer(model.parameters())
        _train(tsm, recipe, model, opt, ctx.device, range(recipe.steps),
               lambda step, loss: tracker.step(step, loss, _full_params(model)))  # fmt: skip
        return Result(tracker.result(), tol, _layout(tsm))


def hybrid_shard(ctx: Context, inj: Injector) -> Result:
    """hybrid_shard_degree 2: shard groups of 2, the other ranks replicas (the scripts' FSDP call)."""
    _require(ctx, 2, "hybrid sharding (hybrid_shard_degree 2)")
    return _run(ctx, {"hybrid_shard_degree": 2})


def tp_hybrid_shard(ctx: Context, inj: Injector) -> Result:
    """tensor_parallel_degree 2 × hybrid_shard_degree 2: tsm.transform, then the FSDP call."""
    _require(ctx, 4, "tensor parallelism × hybrid sharding (tp 2 × hybrid_shard_degree 2)")
    return _run(ctx, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2})


def context_parallel(ctx: Context, inj: Injector) -> Result:
    """context_parallel_degree 2 (ring attention) in shard groups of 2: each rank holds the head and tail chunks
    of its data-parallel rank's sequences (sequences of 8 tokens: two chunks per cp rank)."""
    import dataclasses

    _require(ctx, 2, "context parallelism (context_parallel_degree 2)")
    try:
        from transformers import AttentionInterface  # noqa: F401
    except ImportError:
        raise Skipped("context parallelism needs Hugging Face's AttentionInterface (transformers >= 4.48)") from None
    base = llama_recipe()

    def longer(n: int) -> list[tuple[torch.Tensor, ...]]:
        return [(torch.cat([ids, ids.flip(1)[:, :2]], dim=1),) for (ids,) in base.batches(n)]

    params = {"hybrid_shard_degree": 2, "context_parallel_degree": 2}
    return _run(ctx, params, dataclasses.replace(base, batches=longer))


def expert_parallel(ctx: Context, inj: Injector) -> Result:
    """expert_parallel_degree 2 × hybrid_shard_degree 2 on Mixtral, dropless top-2 routing (``"none"``, no z
    loss: the model stock Mixtral computes): each rank runs half the experts for every rank's tokens."""
    import transformers

    from smp_compat.v2.moe.moe_config import MoEConfig

    _require(ctx, 2, "expert parallelism (expert_parallel_degree 2)")
    if int(transformers.__version__.split(".")[0]) < 5:
        raise Skipped(f"expert parallelism needs transformers 5's stacked Mixtral experts; {transformers.__version__}")
    config = MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0)
    params = {"hybrid_shard_degree": 2, "expert_parallel_degree": 2}
    return _run(ctx, params, mixtral_recipe(), config=config)


def user_config(ctx: Context, inj: Injector) -> Result:
    """The user's SMP v2 --config (tp, hybrid_shard_degree, ...) on the v2 model, as tsm.init would take it."""
    from smp_compat.v2.config import resolve_v2_config

    params = dict(ctx.user_config or {})
    cfg = resolve_v2_config(params, environ={})
    cfg.check_world_size(ctx.env.world_size)
    _require(ctx, cfg.tensor_parallel_degree, "this config")
    return _run(ctx, params)


def sharded_resume(ctx: Context, inj: Injector) -> Result:
    """Two steps, a sharded (DCP) save of model and optimizer, a fresh tsm.init and a differently seeded model,
    the load, a third step: the same as three steps straight."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _require(ctx, 2, "a sharded checkpoint (hybrid_shard_degree 2)")
    recipe, tol, params = llama_recipe(), ctx.fp32, {"hybrid_shard_degree": 2}
    folder = shared_folder(ctx)
    tracker = Tracker(reference_run(recipe, SAMPLES_PER_DP_RANK * ctx.env.world_size, ctx.device), tol)

    def observe_with(model: nn.Module) -> Callable[[int, float], None]:
        return lambda step, loss: tracker.step(step, loss, _full_params(model))

    with _v2(params) as tsm:
        model = _wrap(tsm, _seeded(recipe, 0), ctx.device)
        opt = recipe.optimizer(model.parameters())
        _train(tsm, recipe, model, opt, ctx.device, range(2), observe_with(model))
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    with _v2(params) as tsm:
        model = _wrap(tsm, _seeded(recipe, 5), ctx.device)
        opt = recipe.optimizer(model.parameters())
        model_state, optim_state = get_state_dict(model, opt)  # targets, optimizer state included
        loaded = {"model": model_state, "optim": optim_state}
        dcp.load(loaded, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        _train(tsm, recipe, model, opt, ctx.device, range(2, recipe.steps), observe_with(model))
        return Result(tracker.result(), tol, _layout(tsm) + " resumed")
