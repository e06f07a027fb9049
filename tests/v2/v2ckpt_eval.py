"""Rank bodies for issue 39, item 1: AWS's v2 scripts evaluate at the step they checkpoint.

train_lib.py's loop, scaled down: each step the scripts' training step; every ``EVERY`` steps ``eval_model``
(``model.eval()``, ``torch.no_grad()``, the validation batches, the loss all-reduced, ``model.train()``), then
``save_checkpoint`` of one type (v2ckpt_types.py). A case may also run a forward with gradients whose loss
is dropped (no backward) right before each save. The model goes through the scripts' FSDP call (the
façade) after ``tsm.transform`` where the layout needs it (tp, cp, ep).

``straight`` trains ``STEPS`` steps, evaluating and saving at ``EVERY`` and ``2 * EVERY``; ``resume`` is a
new job (fresh processes, a fresh container, other initial weights) that loads the first checkpoint and
trains on with the same evaluations and saves. Several cases run one after another in the same ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import fsdp_job
import torch
import torch.distributed as dist
import v2ckpt_types
from torch import nn

from fresh_home import fresh_container

__all__ = ["Case", "LAYOUTS", "EVERY", "STEPS", "jobs"]

EVERY, STEPS, VAL_BATCHES = 2, 4, 2
LAYOUTS: dict[str, dict[str, int]] = {
    "hsd2": {"hybrid_shard_degree": 2},
    "hsd1": {"hybrid_shard_degree": 1},
    "hsd0": {"hybrid_shard_degree": 0},
    "tp2": {"hybrid_shard_degree": 2, "tensor_parallel_degree": 2},
    "tp2cp2": {"hybrid_shard_degree": 2, "tensor_parallel_degree": 2, "context_parallel_degree": 2},
    "ep2": {"hybrid_shard_degree": 4, "expert_parallel_degree": 2},
}


@dataclass(frozen=True)
class Case:
    """One checkpoint type at one layout; ``dropped``: also a forward with no backward before each save."""

    kind: str
    layout: str
    dropped: bool = False

    def __str__(self) -> str:
        return f"{self.kind}@{self.layout}" + ("+dropped" if self.dropped else "")


def _model(case: Case, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """tsm.init with the layout, the tiny model (Llama, or Mixtral for ep), transform where needed, FSDP."""
    import smp_compat.v2  # noqa: F401 - the torch.sagemaker finder, as `smp-compat run` installs it
    import torch.sagemaker as tsm
    from smp_compat.v2.state import reset

    reset()
    degrees = LAYOUTS[case.layout]
    tsm.init(degrees)
    parallel = any(degrees.get(f"{d}_parallel_degree", 1) > 1 for d in ("tensor", "context", "expert"))
    if case.layout == "ep2":
        import moe_job
        from torch.sagemaker.moe.moe_config import MoEConfig

        model = tsm.transform(moe_job.tiny_mixtral(seed), config=MoEConfig())
    else:
        model = tsm.transform(fsdp_job.tiny_llama(seed)) if parallel else fsdp_job.tiny_llama(seed)
    layer = None
    if parallel:  # the scripts' auto-wrap class after transform
        from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

        layer = TransformerLayer
    model = fsdp_job.wrap_as_scripts(model, layer=layer)
    return model, fsdp_job.adamw(model)


def _ids(step: int) -> torch.Tensor:
    """The data-parallel rank's batch of ``step``, cut for the cp rank as the scripts' get_batch_for_cp_rank."""
    import torch.sagemaker as tsm
    from smp_compat.v2.context_parallel import split_for_cp_rank

    ids = fsdp_job.batch(step, tsm.state.dp_rank)
    return split_for_cp_rank(ids, tsm.state.cp_size, tsm.state.cp_rank) if tsm.state.cp_size > 1 else ids


def _mean(value: torch.Tensor) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """The scripts' step: forward, backward, clip_grad_norm_, optimizer step; the world-mean loss."""
    from torch.sagemaker.grad_norm import clip_grad_norm_

    optimizer.zero_grad(set_to_none=True)
    ids = _ids(step)
    loss = model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
    loss.backward()
    clip_grad_norm_(model, fsdp_job.CLIP)
    optimizer.step()
    return _mean(loss)


def _evaluate(model: nn.Module) -> float:
    """train_lib.py's eval_model: eval mode, no gradients, the loss summed over the batches, then train mode."""
    model = model.eval()
    loss = torch.zeros(())
    with torch.no_grad():
        for i in range(VAL_BATCHES):
            ids = _ids(10_000 + i)
            loss += model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
    model.train()
    return _mean(loss) / VAL_BATCHES


def _dropped_forward(model: nn.Module) -> None:
    """A forward with gradients on whose loss is never backpropagated (a step that skips its backward)."""
    ids = _ids(20_000)
    model(input_ids=ids, attention_mask=None, labels=ids)["loss"].detach()


def _run(case: Case, model: nn.Module, optimizer: torch.optim.Optimizer, folder: str, steps: range) -> dict:
    """The loop from ``steps.start``: train, and every EVERY steps evaluate, then checkpoint into folder/<N>."""
    losses, evals = [], {}
    for step in steps:
        losses.append(_train_step(model, optimizer, step))
        done = step + 1
        if done % EVERY == 0:
            evals[done] = _evaluate(model)
            if case.dropped:
                _dropped_forward(model)
            v2ckpt_types.save(case.kind, model, optimizer, os.path.join(folder, str(done)), {"total_steps": done})
    v2ckpt_types.finalize()
    return {"losses": losses, "evals": evals, "params": fsdp_job.full_params(model)}


def _straight(case: Case, folder: str) -> dict[str, Any]:
    model, optimizer = _model(case, seed=0)
    out = _run(case, model, optimizer, folder, range(STEPS))
    if case.kind == "full" and dist.get_rank() == 0:
        out["saved"] = torch.load(os.path.join(folder, str(EVERY), "pytorch_model.bin"), weights_only=True)
    return out


def _resume(case: Case, folder: str) -> dict[str, Any]:
    """Load the checkpoint of step EVERY into a model of other weights; ``full`` holds weights only, so that
    case evaluates the loaded model instead of training on."""
    model, optimizer = _model(case, seed=7)
    state = v2ckpt_types.load(case.kind, model, optimizer, os.path.join(folder, str(EVERY)), {"total_steps": EVERY})
    loaded = fsdp_job.full_params(model)
    if case.kind == "full":
        return {"loaded": loaded, "evals": {EVERY: _evaluate(model)}}
    out = _run(case, model, optimizer, folder + "-resumed", range(int(state["total_steps"]), STEPS))
    return out | {"loaded": loaded}


def jobs(kind: str, cases: list[Case], root: str, home: str) -> list[dict[str, Any]]:
    """Each case's straight run (``kind`` "straight") or resume, one after another in these ranks."""
    fresh_container(home)
    body = _straight if kind == "straight" else _resume
    results = []
    for case in cases:
        try:
            results.append(body(case, os.path.join(root, str(case))))
        except Exception as e:  # several cases share the job: say which one failed
            raise RuntimeError(f"{kind} job, case {case}: {type(e).__name__}: {e}") from e
    return results
