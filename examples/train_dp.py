"""A data-parallel training script written for SageMaker's SMP v1, the way AWS's examples are shaped.

It imports ``smdistributed.modelparallel.torch`` and runs unchanged under ``smp-compat run``; with plain
``python`` (no shim on the path) it falls back to ``import smp_compat as smp``. CPU-only, a few seconds:

    smp-compat run --config examples/configs/dp2.json examples/train_dp.py
    python examples/train_dp.py                      # a world of one, default config
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

try:
    import smdistributed.modelparallel.torch as smp

    SMP_IMPORT = "smdistributed.modelparallel.torch"
except ImportError:  # no SageMaker, no `smp-compat run`: use smp_compat directly
    import smp_compat as smp

    SMP_IMPORT = "smp_compat"

__all__ = ["DEFAULT_CONFIG", "IN_FEATURES", "SMP_IMPORT", "main", "make_batches", "make_model"]

DEFAULT_CONFIG = {"microbatches": 2, "ddp": True}
"""Used when the launcher gave no config (SM_HP_MP_PARAMETERS unset); the launcher's keys win over it."""

IN_FEATURES = 8


def make_model(seed: int = 0) -> nn.Module:
    """A small MLP with fixed initial weights, so every rank and the reference start equal."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def make_batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic regression data: the same global batches on every rank, each rank then takes its shard."""
    g = torch.Generator().manual_seed(seed)
    true_w = torch.randn(IN_FEATURES, 1, generator=g)
    batches = []
    for _ in range(steps):
        x = torch.randn(global_batch, IN_FEATURES, generator=g)
        batches.append((x, torch.tanh(x @ true_w / IN_FEATURES**0.5)))
    return batches


def init_smp(use_script_config: bool) -> None:
    """``smp.init()`` takes the launcher's config from SM_HP_MP_PARAMETERS; a script dict is the fallback."""
    if smp.is_initialized():  # mpirun + SM_HP_MP_PARAMETERS: importing smp already initialized (as in SMP)
        return
    if use_script_config or "SM_HP_MP_PARAMETERS" not in os.environ:
        smp.init(DEFAULT_CONFIG)  # keys in SM_HP_MP_PARAMETERS override these, as on SageMaker
    else:
        smp.init()


@smp.step
def train_step(model: smp.DistributedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One microbatch: forward, loss, ``model.backward`` (SMP's replacement for ``loss.backward()``)."""
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--out", help="rank 0 saves losses, final parameters and the resolved config here")
    parser.add_argument(
        "--script-config", action="store_true", help="always call smp.init(DEFAULT_CONFIG) (env still overrides)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    initialized_on_import = smp.is_initialized()
    init_smp(args.script_config)
    model = smp.DistributedModel(make_model())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr))

    per_rank = args.global_batch // smp.dp_size()
    start = smp.dp_rank() * per_rank
    losses = []
    for step, (x, y) in enumerate(make_batches(args.steps, args.global_batch)):
        optimizer.zero_grad()
        out = train_step(model, x[start : start + per_rank], y[start : start + per_rank])
        optimizer.step()
        # Each rank's loss is the mean over its shard; the global batch loss is their mean.
        loss = sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size()
        losses.append(loss)
        if smp.rank() == 0:
            print(f"step {step}: loss {loss:.6f}", flush=True)

    if args.out and smp.rank() == 0:
        result = {
            "losses": losses,
            "params": model.state_dict(),
            "config": smp.state.cfg.to_dict(),
            "world_size": smp.size(),
            "dp_size": smp.dp_size(),
            "smp_import": SMP_IMPORT,
            "initialized_on_import": initialized_on_import,
        }
        torch.save(result, args.out)
    smp.barrier()


if __name__ == "__main__":
    main()
