"""The battery: each check trains a tiny model under one smp config and holds it against one-process PyTorch.

Every check calls ``smp.init`` with its own config in the processes the launcher started, and the runner
calls ``smp.reset`` after it (the job's process group stays up: ``globalstate.release_process_group``).
Re-initializing costs a few process groups (tens of milliseconds); a sub-job per check would cost a
launch, ``import torch`` and a rendezvous each (several seconds on a busy CPU host), and could not test the
groups of the job the user launched. What a check needs that the job lacks (ranks, a GPU per process,
transformers, bf16 on the device) makes it SKIP with the reason, decided from the gathered environment, so
identically on every rank.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.config import SMP_KEYS, resolve_config
from smp_compat.selftest.environment import Environment
from smp_compat.selftest.faults import Fault, Injector
from smp_compat.selftest.models import Recipe, adam, gpt2_recipe, lm_recipe, mlp_recipe
from smp_compat.selftest.training import Measured, Tolerance, Tracker, compared_params, reference_run, smp_run
from smp_compat.v2.config import V2_KEYS

__all__ = ["CHECKS", "Check", "Context", "Result", "Skipped", "check_names", "select"]

V2_ONLY_KEYS = frozenset(V2_KEYS - SMP_KEYS)
"""Keys only SMP v2 has: a --config with one of them is checked as SMP v2's."""

FP32_CPU = Tolerance(1e-5, 1e-6)
FP32_GPU = Tolerance(1e-4, 1e-5)  # GPU kernels sum in other orders (and differ between batch shapes)
FP16 = Tolerance(5e-3, 5e-3)  # 16-bit parameters against the fp32 run: about 10 units of fp16's last place
BF16 = Tolerance(3e-2, 3e-2)  # bf16 keeps 8 bits of mantissa: ~4e-3 per rounding, a few steps of them


class Skipped(Exception):
    """A check cannot run in this job; the message says what it lacks."""


@dataclass
class Context:
    """What every check gets: the smp module, the gathered environment, the fault (tests only), options."""

    smp: Any
    env: Environment
    faults: list[Fault]
    user_config: dict[str, Any] | None
    checkpoint_root: str
    made_folders: list[str]

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def device(self) -> torch.device:
        return torch.device(self.env.ranks[self.rank].device)

    @property
    def fp32(self) -> Tolerance:
        return FP32_CPU if self.device.type == "cpu" else FP32_GPU


@dataclass(frozen=True)
class Result:
    """A check's finding on one rank."""

    measured: Measured
    tolerance: Tolerance
    layout: str
    links: str | None = None  # how this rank's pipeline messages travelled


def _links(model: Any) -> str | None:
    """``"rank 1: shared memory"``: the channel each pipeline peer of this rank used (None without a pipeline)."""
    engine = getattr(model, "pipeline_engine", None)
    if engine is None:
        return None
    return ", ".join(f"rank {peer}: {kind}" for peer, kind in sorted(engine.transport.links().items()))


@dataclass(frozen=True)
class Check:
    name: str
    about: str
    run: Callable[[Context, Injector], Result]


# ---------------------------------------------------------------- the shared training flow


def _layout(smp: Any) -> str:
    """``pp2×dp2 spread``: the degrees greater than one, and the placement where it matters."""
    cfg = smp.state.cfg
    parts = [f"{axis}{size}" for axis, size in (("pp", smp.pp_size()), ("tp", smp.tp_size()),
             ("sdp", cfg.sharded_data_parallel_degree), ("dp", smp.rdp_size())) if size > 1]  # fmt: skip
    text = "×".join(parts) or "1 rank"
    if smp.pp_size() > 1 and smp.rdp_size() > 1:
        text += f" {cfg.placement_strategy}"
    return text


def _global_batch(config: dict[str, Any], world: int) -> int:
    """Two samples per microbatch on each data-parallel rank (prescaled: on each tp rank of a replica)."""
    cfg = resolve_config(config, environ={})
    return world // cfg.pipeline_parallel_degree * cfg.microbatches * 2


def _creation(smp: Any, dtype: torch.dtype | None, tp_swap: bool) -> contextlib.AbstractContextManager[Any]:
    if dtype is None and not tp_swap:
        return contextlib.nullcontext()
    return smp.model_creation(tensor_parallelism=tp_swap, dtype=dtype)


def _reference_start(recipe: Recipe) -> dict[str, torch.Tensor]:
    """The reference's initial weights, which a model built in 16 bits takes (rounded) before training.

    torch below 2.12 draws bf16 / fp16 random numbers on CPU in another order than fp32 ones, so the same
    seed gave a 16-bit model other weights than the reference's: a different start, not a training fault.
    """
    torch.manual_seed(0)
    return recipe.build().state_dict()


def train_and_compare(ctx: Context, inj: Injector, config: dict[str, Any], recipe: Recipe, tol: Tolerance, *,
                      dtype: torch.dtype | None = None, tp_swap: bool = False, cast: torch.dtype | None = None,
                      scaler: bool = False, rename: Any = None, prepare: Any = None) -> Result:  # fmt: skip
    """Reference first (``smp.nn`` modules are whole only before ``smp.init``), then init, wrap, train, compare."""
    smp = ctx.smp
    batch = _global_batch(config, ctx.env.world_size)
    tracker = Tracker(reference_run(recipe, batch, ctx.device, cast), tol)
    smp.init(config)
    with _creation(smp, dtype, tp_swap):
        torch.manual_seed(0)
        net = recipe.build()
    if dtype is not None and not tp_swap:
        net.load_state_dict(_reference_start(recipe))
    model = smp.DistributedModel(net)
    if prepare is not None:
        prepare(smp, model)
    opt = smp.DistributedOptimizer(recipe.optimizer(model.parameters()))
    grad_scaler = smp.amp.GradScaler() if scaler else None
    whole = smp.tp_size() > 1 or smp.state.cfg.sharded_data_parallel_degree > 1

    def observe(step: int, loss: float) -> None:
        tracker.step(step, loss, compared_params(smp, model, whole, rename))

    smp_run(smp, recipe, model, opt, batch, inj, observe, cast=cast, scaler=grad_scaler)
    return Result(tracker.result(), tol, _layout(smp), _links(model))


def _need_even(ctx: Context, what: str) -> None:
    if ctx.env.world_size % 2:
        raise Skipped(f"{what} needs an even number of ranks; this job has {ctx.env.world_size}")


def _pp2(ctx: Context, **keys: Any) -> dict[str, Any]:
    """pp = 2 (× dp) when the world allows it, else one stage (× dp)."""
    base = {"ddp": True, "microbatches": 2, **keys}
    return {**base, "pipeline_parallel_degree": 2} if ctx.env.world_size % 2 == 0 else base


# ---------------------------------------------------------------- the checks


def data_parallel(ctx: Context, inj: Injector) -> Result:
    if ctx.env.world_size < 2:
        raise Skipped("data parallelism needs 2 ranks or more")
    return train_and_compare(ctx, inj, {"ddp": True, "microbatches": 2}, mlp_recipe(), ctx.fp32)


def _pipeline(pipeline: str, microbatches: int) -> Callable[[Context, Injector], Result]:
    def check(ctx: Context, inj: Injector) -> Result:
        _need_even(ctx, "pipeline parallelism (pp = 2)")
        config = {"pipeline_parallel_degree": 2, "microbatches": microbatches, "ddp": True, "pipeline": pipeline}
        return train_and_compare(ctx, inj, config, mlp_recipe(), ctx.fp32)

    return check


def spread_pipeline(ctx: Context, inj: Injector) -> Result:
    if ctx.env.world_size % 4:
        raise Skipped("a pipeline on non-neighbouring ranks needs pp = 2 × dp = 2 (a multiple of 4 ranks); with "
                      f"{ctx.env.world_size} every placement puts a pipeline's stages side by side")
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "placement_strategy": "spread"}
    return train_and_compare(ctx, inj, config, mlp_recipe(), ctx.fp32)


def tensor_parallel(ctx: Context, inj: Injector) -> Result:
    _need_even(ctx, "tensor parallelism (tp = 2)")
    return train_and_compare(ctx, inj, {"tensor_parallel_degree": 2, "ddp": True}, lm_recipe(), ctx.fp32, tp_swap=True)


def tensor_parallel_hf(ctx: Context, inj: Injector) -> Result:
    _need_even(ctx, "tensor parallelism (tp = 2)")
    lacking = [i.rank for i in ctx.env.ranks if i.versions.get("transformers") is None]
    if lacking:
        raise Skipped(f"transformers is not installed (ranks {lacking})")
    from smp_compat.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

    return train_and_compare(ctx, inj, {"tensor_parallel_degree": 2, "ddp": True}, gpt2_recipe(), ctx.fp32,
                             tp_swap=True, rename=translate_state_dict_to_hf_gpt2)  # fmt: skip


def sharded_data_parallel(ctx: Context, inj: Injector) -> Result:
    _need_even(ctx, "sharded data parallelism (sdp = 2)")
    if ctx.device.type == "cuda" and ctx.env.backend != "nccl":
        raise Skipped("FSDP2 on GPUs needs NCCL, and ranks here share a GPU (gloo)")
    config = {"ddp": True, "microbatches": 2, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0}
    return train_and_compare(ctx, inj, config, mlp_recipe(), ctx.fp32)


def _sixteen_bit(key: str) -> Callable[[Context, Injector], Result]:
    dtype, tol = (torch.float16, FP16) if key == "fp16" else (torch.bfloat16, BF16)

    def check(ctx: Context, inj: Injector) -> Result:
        if key == "bf16" and not ctx.env.bf16_on_device:
            raise Skipped("a GPU of this job has no bf16")
        return train_and_compare(ctx, inj, _pp2(ctx, **{key: True}), mlp_recipe(), tol, dtype=dtype)

    return check


def amp(ctx: Context, inj: Injector) -> Result:
    """torch autocast in the step body (fp16 on GPUs; bf16 on CPU, autocast's CPU type) with smp.amp.GradScaler."""
    cast, tol = (torch.float16, FP16) if ctx.device.type == "cuda" else (torch.bfloat16, BF16)
    return train_and_compare(ctx, inj, _pp2(ctx), mlp_recipe(), tol, cast=cast, scaler=True)


def activation_checkpointing(ctx: Context, inj: Injector) -> Result:
    def prepare(smp: Any, model: Any) -> None:
        smp.set_activation_checkpointing(model.get_module().b)

    return train_and_compare(ctx, inj, _pp2(ctx), mlp_recipe(depth=4), ctx.fp32, prepare=prepare)


def shared_folder(ctx: Context) -> str:
    """A fresh folder under the checkpoint root, made by rank 0, that every rank must see (a collective)."""
    made = [tempfile.mkdtemp(prefix="smp-selftest-", dir=ctx.checkpoint_root) if ctx.rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(made, src=0)
    folder = str(made[0])
    if ctx.rank == 0:
        ctx.made_folders.append(folder)
    seen: list[Any] = [os.path.isdir(folder)]
    if dist.is_initialized():
        seen = [None] * ctx.env.world_size
        dist.all_gather_object(seen, os.path.isdir(folder))
    if not all(seen):
        raise Skipped(f"ranks {[r for r, s in enumerate(seen) if not s]} cannot see {folder}: pass --checkpoint-dir "
                      "on a filesystem every host shares")  # fmt: skip
    return folder


def checkpoint_resume(ctx: Context, inj: Injector) -> Result:
    """Two steps, ``smp.save_checkpoint``, a fresh smp and a differently seeded model, ``smp.resume_from_checkpoint``,
    a third step: the same as three steps straight."""
    smp, recipe, config = ctx.smp, mlp_recipe(optimizer=adam), _pp2(ctx)
    folder = shared_folder(ctx)
    batch = _global_batch(config, ctx.env.world_size)
    tracker = Tracker(reference_run(recipe, batch, ctx.device), ctx.fp32)
    smp.init(config)
    model = smp.DistributedModel(_seeded(recipe, 0))
    opt = smp.DistributedOptimizer(recipe.optimizer(model.parameters()))

    def observe(step: int, loss: float) -> None:
        tracker.step(step, loss, compared_params(smp, model, False))

    smp_run(smp, recipe, model, opt, batch, inj, observe, steps=range(2))
    smp.save_checkpoint(folder, tag="selftest", partial=True, model=model, optimizer=opt, user_content={"step": 2})
    smp.barrier()
    smp.reset()
    smp.init(config)
    user = smp.resume_from_checkpoint(folder, tag="selftest")
    model = smp.DistributedModel(_seeded(recipe, 5))
    opt = smp.DistributedOptimizer(recipe.optimizer(model.parameters()))
    smp_run(smp, recipe, model, opt, batch, inj, observe, steps=range(2, 3))
    measured = tracker.result()
    if user != {"step": 2} and measured.problem is None:
        measured = Measured(measured.worst, f"resume_from_checkpoint returned {user!r}, saved {{'step': 2}}", 3.0)
    return Result(measured, ctx.fp32, _layout(smp), _links(model))


def _seeded(recipe: Recipe, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return recipe.build()


def user_config(ctx: Context, inj: Injector) -> Result:
    """The config given with --config (or SM_HP_MP_PARAMETERS), on a built-in model it can partition and split."""
    params = dict(ctx.user_config or {})
    if set(params) & V2_ONLY_KEYS:  # an SMP v2 config: its own check on the v2 model
        return _v2_check("user_config")(ctx, inj)
    cfg = resolve_config(params, environ={})
    pp, tp = cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree
    recipe = lm_recipe(layers=max(2, pp)) if tp > 1 else mlp_recipe(depth=max(3, 2 * pp))
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None
    tol = FP16 if cfg.fp16 else BF16 if cfg.bf16 else ctx.fp32
    return train_and_compare(ctx, inj, params, recipe, tol, dtype=dtype, tp_swap=tp > 1)


def _v2_check(name: str) -> Callable[[Context, Injector], Result]:
    """An SMP v2 check (``v2_checks.py``, which builds on this module), imported when it runs."""

    def check(ctx: Context, inj: Injector) -> Result:
        from smp_compat.selftest import v2_checks

        return getattr(v2_checks, name)(ctx, inj)

    return check


CHECKS: tuple[Check, ...] = (
    Check("dp", "data parallel: gradients averaged over every rank", data_parallel),
    Check("pp2-simple", "pipeline pp = 2, simple schedule", _pipeline("simple", 2)),
    Check("pp2-interleaved", "pipeline pp = 2, interleaved schedule, 4 microbatches", _pipeline("interleaved", 4)),
    Check("pp2-spread", "pipeline pp = 2 on non-neighbouring ranks (placement spread)", spread_pipeline),
    Check("tp2", "tensor parallel tp = 2, a model of smp.nn modules", tensor_parallel),
    Check("tp2-hf", "tensor parallel tp = 2, Hugging Face GPT-2 swapped for smp.nn", tensor_parallel_hf),
    Check("sdp2", "sharded data parallel (FSDP2) sdp = 2", sharded_data_parallel),
    Check("fp16", "fp16 parameters with fp32 master weights", _sixteen_bit("fp16")),
    Check("bf16", "bf16 parameters with fp32 master weights", _sixteen_bit("bf16")),
    Check("amp", "autocast with smp.amp.GradScaler", amp),
    Check("activation-checkpointing", "smp.set_activation_checkpointing on a pipeline stage's module",
          activation_checkpointing),
    Check("checkpoint-resume", "smp.save_checkpoint, then smp.resume_from_checkpoint", checkpoint_resume),
    Check("v2-hsd2", "SMP v2: the scripts' FSDP call at hybrid_shard_degree 2 (Hugging Face Llama)",
          _v2_check("hybrid_shard")),
    Check("v2-tp2-hsd2", "SMP v2: tsm.transform tp 2 x hybrid_shard_degree 2", _v2_check("tp_hybrid_shard")),
    Check("v2-cp2", "SMP v2: context_parallel_degree 2 (ring attention, whole-sequence loss)",
          _v2_check("context_parallel")),
    Check("v2-ep2", "SMP v2: expert_parallel_degree 2 x hybrid_shard_degree 2 (Mixtral, dropless top-2)",
          _v2_check("expert_parallel")),
    Check("v2-sharded-resume", "SMP v2: sharded (DCP) save, fresh tsm.init, load, one more step",
          _v2_check("sharded_resume")),
)  # fmt: skip
"""Every built-in check, in the order they run."""

USER_CHECK = Check("user-config", "your --config on a built-in model", user_config)


def check_names() -> list[str]:
    return [c.name for c in (*CHECKS, USER_CHECK)]


def select(names: list[str] | None, with_user: bool) -> list[Check]:
    """The checks to run: all (the user's config last), or those named, in the battery's order."""
    from smp_compat.errors import SMPConfigError

    battery = [*CHECKS, *([USER_CHECK] if with_user else [])]
    if names is None:
        return battery
    unknown = sorted(set(names) - set(check_names()))
    if unknown:
        raise SMPConfigError(f"unknown check(s) {', '.join(unknown)}; the checks are: {', '.join(check_names())}")
    if USER_CHECK.name in names and not with_user:
        raise SMPConfigError("--checks names user-config, but no --config (or SM_HP_MP_PARAMETERS) was given")
    return [c for c in battery if c.name in names]
