"""pp = 2 resident memory over a long run: does a rank's memory stay flat from step to step?

A training job runs for days, so a pipeline that keeps a few megabytes per step runs out of memory where
a short benchmark sees nothing (smp_compat's transport kept every message buffer on gloo until this was
measured). Each rank reads its resident set size (``/proc/self/statm``) after ``--warmup`` steps and
again after ``--steps`` more, for smp_compat's interleaved pipeline and then torch's Schedule1F1B in the
same 2-rank job (same MLP, split and batches as ``pp_throughput.py``).

    python benchmarks/pp_rss.py [--width 512 --batch 256 --steps 150]

Target: smp_compat grows by less than ``--limit`` KiB per step on every rank (default 64: allocator
noise, far below one activation message).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pp_workload import SmpRunner, TorchRunner, bind_to_core, make_batches, preload  # noqa: E402
from smp_compat.testing import run_ranks  # noqa: E402

__all__ = ["main", "parse_args", "run"]

KiB = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=8, help="Linear layers, split in half between the two ranks")
    p.add_argument("--batch", type=int, default=256, help="samples per step")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (both libraries)")
    p.add_argument("--warmup", type=int, default=20, help="steps before the first reading")
    p.add_argument("--steps", type=int, default=150, help="steps between the two readings")
    p.add_argument("--limit", type=float, default=64.0, help="largest growth per step (KiB) that passes")
    p.add_argument("--timeout", type=float, default=900.0, help="hard limit for the 2-rank job, seconds")
    return p.parse_args(argv)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _growth_per_step(runner: Any, batches: list, warmup: int, steps: int) -> tuple[float, float]:
    """(resident MiB after the warm-up, KiB gained per step after it)."""
    for i in range(warmup):
        runner.step(*batches[i % len(batches)])
    before = _resident_bytes()
    for i in range(steps):
        runner.step(*batches[i % len(batches)])
    return before / 2**20, (_resident_bytes() - before) / KiB / steps


def _rank(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    torch.set_num_threads(1)
    bind_to_core(dist.get_rank())
    batches = make_batches(args.width, args.batch)
    smp_runner = SmpRunner.create(args.width, args.layers, args.microbatches)
    torch_runner = TorchRunner.create("torch-1F1B", args.width, args.layers, args.batch, args.microbatches)
    return {
        "smp-interleaved": _growth_per_step(smp_runner, batches, args.warmup, args.steps),
        "torch-1F1B": _growth_per_step(torch_runner, batches, args.warmup, args.steps),
    }


def run(args: argparse.Namespace) -> list[dict[str, tuple[float, float]]]:
    preload()
    return run_ranks(_rank, 2, args, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    per_rank = run(args)
    table = Table(title=f"pp=2 resident memory: MLP width {args.width}, batch {args.batch}, {args.microbatches} "
                        f"microbatches, {args.steps} steps after {args.warmup}")  # fmt: skip
    for column in ("variant", "rank", "MiB after warm-up", "KiB / step after"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for variant in per_rank[0]:
        for rank, figures in enumerate(per_rank):
            resident, growth = figures[variant]
            table.add_row(variant, str(rank), f"{resident:.0f}", f"{growth:+.1f}")
    worst = max(figures["smp-interleaved"][1] for figures in per_rank)
    met = worst < args.limit
    console = Console()
    console.print(table)
    console.print(f"Target: smp-interleaved grows < {args.limit:.0f} KiB/step on every rank: worst {worst:+.1f} "
                  f"({'met' if met else 'missed'})")  # fmt: skip
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
