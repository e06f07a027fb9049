"""Record what a pp = 2, microbatches = 4 pipeline step does on each rank, as a Chrome trace.

An SMP-style script (``@smp.step``, ``smp.DistributedModel``, ``smp.partition``) that trains a small MLP
split over two pipeline stages, then records the timeline of its last steps with
``smp_compat.timeline`` and writes it on rank 0. One command records and draws it (CPU is fine):

    smp-compat run --nproc-per-node 2 examples/timeline_demo.py --trace out.json && smp-compat timeline out.json --svg docs/img/timeline.svg

The trace also opens in chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    import smdistributed.modelparallel.torch as smp
except ImportError:  # not launched through `smp-compat run`: use smp_compat directly
    import smp_compat as smp

from smp_compat import timeline

__all__ = ["DEFAULT_CONFIG", "Stage", "TwoStageMLP", "main", "parse_args", "train_step", "write_trace"]

DEFAULT_CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0}
"""The script's own config; keys from the launcher (SM_HP_MP_PARAMETERS) override it, as on SageMaker."""


class Stage(nn.Module):
    """Half of the network: a few wide Linear + Tanh layers (compute dominates the traffic)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TwoStageMLP(nn.Module):
    """Stage 0 and stage 1, placed by hand with ``smp.partition`` (a no-op under auto partition)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        with smp.partition(0):
            self.first = Stage(width, layers)
        with smp.partition(1):
            self.second = Stage(width, layers)
            self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


@smp.step
def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One microbatch: forward through both stages, loss, backward."""
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="timeline.json", help="Chrome-trace JSON written by rank 0")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4, help="Linear layers per stage")
    parser.add_argument("--batch", type=int, default=256, help="global batch of each step")
    parser.add_argument("--warmup", type=int, default=3, help="steps before recording (the first partitions)")
    parser.add_argument("--steps", type=int, default=2, help="steps recorded")
    return parser.parse_args(argv)


def _init() -> None:
    """smp.init with the script's dict unless importing under mpirun already initialized (as in SMP)."""
    if not smp.is_initialized():
        smp.init(DEFAULT_CONFIG)


def write_trace(path: str, events: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The Chrome trace plus what the picture needs to compute the ideal: pp, microbatches, schedule."""
    cfg = smp.state.cfg
    other = {
        "pp": cfg.pipeline_parallel_degree,
        "microbatches": cfg.microbatches,
        "pipeline": cfg.pipeline,
        "world_size": smp.size(),
        "recorded_steps": args.steps,
        "model": f"MLP {2 * args.layers} x Linear({args.width}), batch {args.batch}",
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"traceEvents": events, "otherData": other}))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    _init()
    torch.manual_seed(0)
    model = smp.DistributedModel(TwoStageMLP(args.width, args.layers))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = torch.randn(args.batch, 1, generator=generator)

    recorder = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            recorder = timeline.enable(smp.rank())
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        optimizer.step()
        if smp.rank() == 0:
            print(f"step {step}: loss {loss.item():.5f}", flush=True)

    events = timeline.gather_chrome_trace()
    idle = smp.allgather(recorder.idle_fraction() if recorder else 0.0, smp.WORLD)
    timeline.disable()
    if smp.rank() == 0 and events is not None:
        write_trace(args.trace, events, args)
        ideal = timeline.ideal_idle_fraction(smp.pp_size(), smp.num_microbatches())
        shown = ", ".join(f"rank {r}: {f:.0%}" for r, f in enumerate(idle))
        print(f"idle fraction {shown} (ideal {ideal:.0%}); trace written to {os.path.abspath(args.trace)}")
    smp.barrier()


if __name__ == "__main__":
    main()
