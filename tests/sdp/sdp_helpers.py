"""Shared pieces of the sharded-data-parallel tests: the plain-PyTorch oracle and an SMP-style sdp run."""

from __future__ import annotations

from typing import Any

import torch

from models import causal_mask, lm_loss, lm_train_step, make_batches, make_model, train_smp

STEPS, GLOBAL_BATCH, LR = 4, 16, 1e-2


def reference(steps: int = STEPS, clip: float = 1.0, accumulate: int = 1) -> tuple[list[float], dict, list[float]]:
    """Plain single-process AdamW on the global batch, clipping the global norm to ``clip`` (SMP's default 1.0)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    mask = causal_mask(8)
    losses, norms = [], []
    for i, (x, y) in enumerate(make_batches(steps, GLOBAL_BATCH)):
        loss = lm_loss(model(x, attention_mask=mask), y)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def init_sdp(sdp: int, **extra: Any) -> tuple[Any, Any, Any]:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": sdp, **extra})
    model = smp.DistributedModel(make_model())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    return smp, model, opt


def train(smp: Any, model: Any, opt: Any, steps: int = STEPS, start: int = 0) -> tuple[list[float], list[float]]:
    """SMP's loop on this rank's slice of the reference batches; global mean losses and clipped norms."""
    step = lm_train_step(smp)
    losses, norms = [], []
    batches = make_batches(start + steps, GLOBAL_BATCH)[start:]
    per_rank = GLOBAL_BATCH // smp.dp_size()
    lo = smp.dp_rank() * per_rank
    for x, y in batches:
        opt.zero_grad()
        out = step(model, x[lo : lo + per_rank], y[lo : lo + per_rank])
        opt.step()
        losses.append(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size())
        norms.append(opt._global_grad_norm)
    return losses, norms


def assert_close_to(reference_result: tuple[list[float], dict, list[float]], losses: list[float], params: dict,
                    norms: list[float] | None = None, rtol: float = 1e-5, atol: float = 1e-6,
                    param_atol: float | None = None) -> None:
    ref_losses, ref_params, ref_norms = reference_result
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    if norms is not None:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=atol)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=rtol, atol=param_atol or atol, msg=lambda m: f"{name}: {m}")


__all__ = ["STEPS", "GLOBAL_BATCH", "reference", "init_sdp", "train", "assert_close_to", "train_smp"]
