"""Per-rank peak memory with and without activation checkpointing, delayed initialization, optimizer sharding.

Each configuration runs in freshly forked ranks (``smp_compat.testing.run_ranks``). Peak memory is the
process's peak resident set (``ru_maxrss``, with glibc told to return large blocks at once) minus its value
before the measured phase, so it counts what the phase added on top of the forked interpreter; exact byte counts are reported where they exist
(parameters materialized on the rank, optimizer state). Sizes are chosen so the effects are tens of MB.

    python benchmarks/memory_features.py [--microbatches 4 --steps 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from smp_compat.host.heap import TUNE_MALLOC_ENV
from smp_compat.testing import run_ranks

__all__ = ["main", "measure"]

MiB = 1 << 20
_M_MMAP_THRESHOLD = -3


def _track_live_memory() -> None:
    """Make glibc return freed large blocks at once (fixed mmap threshold), so peak RSS follows live tensors.

    By default glibc raises its mmap threshold after large frees and keeps later blocks on the heap, so the
    peak RSS would show the allocator's high-water mark rather than what was alive at the same time.
    """
    os.environ[TUNE_MALLOC_ENV] = "0"  # smp.init would fix the thresholds high in this CPU pipeline
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    except OSError:
        pass


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _blocks(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(layers)])  # fmt: skip


def measure(feature: str, enabled: bool, width: int, layers: int, batch: int, microbatches: int,
            steps: int) -> dict[str, Any]:  # fmt: skip
    """One rank's memory for one configuration (run inside run_ranks)."""
    import smp_compat as smp

    _track_live_memory()
    config: dict[str, Any] = {"microbatches": microbatches, "pipeline_parallel_degree": 2,
                              "auto_partition": False, "default_partition": 0}  # fmt: skip
    if feature == "delayed_init":
        config["delayed_parameter_initialization"] = enabled
    if feature == "optimizer_sharding":
        config.update(pipeline_parallel_degree=1, ddp=True, shard_optimizer_state=enabled)
    smp.init(config)
    start = _peak_rss()
    torch.manual_seed(0)
    with smp.model_creation():
        net = _blocks(width, layers)
    model = smp.DistributedModel(net)
    if smp.pp_size() > 1:
        for block in net[layers // 2 :]:
            smp.set_partition(block, 1)
    if feature == "checkpointing" and enabled:
        for block in net:
            smp.set_activation_checkpointing(block, strategy="contiguous")  # each block as one piece
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    @smp.step
    def forward_only(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    x = torch.randn(batch, width)
    with torch.no_grad():
        forward_only(model, x)  # partitions (and materializes, with delayed initialization)
    built = _peak_rss()
    for _ in range(steps):
        opt.zero_grad()
        train_step(model, x)
        opt.step()
    inner = getattr(opt, "optimizer", opt)
    state_bytes = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                      if torch.is_tensor(t))  # fmt: skip
    return {
        "rank": smp.rank(),
        "build_mib": (built - start) / MiB,
        "train_mib": (_peak_rss() - built) / MiB,
        "param_mib": sum(p.numel() * p.element_size() for p in net.parameters() if not p.is_meta) / MiB,
        "optimizer_state_mib": state_bytes / MiB,
    }


# feature -> (title, measured key, what it is, sizes where the feature's effect dominates)
_FEATURES = {
    "checkpointing": ("activation checkpointing (pp=2)", "train_mib", "peak RSS added by 2 training steps",
                      {"width": 512, "layers": 8, "batch": 2048}),
    "delayed_init": ("delayed parameter init (pp=2)", "build_mib", "peak RSS added by building + partitioning",
                     {"width": 1536, "layers": 8, "batch": 8}),
    "optimizer_sharding": ("shard_optimizer_state (dp=2)", "optimizer_state_mib", "Adam state held (exact)",
                           {"width": 512, "layers": 8, "batch": 64}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size (smoke tests use 0.1)")
    args = parser.parse_args(argv)
    table = Table(title=f"per-rank memory in MiB, off vs on (2 ranks, microbatches {args.microbatches})")
    for column in ("feature", "measure", "sizes", "rank", "off", "on", "on/off"):
        table.add_column(column)
    all_lower = True
    for feature, (title, key, what, sizes) in _FEATURES.items():
        sizes = {k: max(2, int(v * args.scale)) for k, v in sizes.items()}
        shape = (sizes["width"], sizes["layers"], sizes["batch"], args.microbatches, args.steps)
        off = run_ranks(measure, 2, feature, False, *shape, timeout=300)
        on = run_ranks(measure, 2, feature, True, *shape, timeout=300)
        label = f"w{sizes['width']} x{sizes['layers']} b{sizes['batch']}"
        for a, b in zip(off, on):
            ratio = b[key] / a[key] if a[key] else float("nan")
            all_lower &= b[key] < a[key]
            table.add_row(title, what, label, str(a["rank"]), f"{a[key]:.1f}", f"{b[key]:.1f}", f"{ratio:.2f}")
    Console(width=140).print(table)
    return 0 if all_lower else 1


if __name__ == "__main__":
    sys.exit(main())
