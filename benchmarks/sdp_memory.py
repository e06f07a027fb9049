"""Per-rank model state under sharded data parallelism: sdp = 1, 2, 4 on the same model and world size.

For each degree, ``--world`` forked ranks train the same MLP stack (a ModuleList of blocks, AdamW) for
``--steps`` steps; each rank reports the bytes it holds of parameters, gradients and optimizer state
(local shards of DTensors) and its peak resident set added by the build and the steps. Per-rank state
should fall to about 1/sdp (the figure of merit: state(sdp) / state(1), target <= 1/sdp + 5 %).

    python benchmarks/sdp_memory.py [--width 512 --layers 8 --world 4 --steps 2 --json out.json]

``--precision bf16`` compares, at sdp = ``--world``, smp_compat (the model built under
``smp.model_creation(dtype=torch.bfloat16)``, ``bf16`` key: fp32 master shards) with plain FSDP2 on the same
fp32 shards and the same ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. Figure of
merit: state(smp) / state(fsdp2) and peak RSS added, target within 5 %.

    python benchmarks/sdp_memory.py --precision bf16 --world 2 [--width 512 --layers 8 --steps 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from smp_compat.testing import run_ranks

__all__ = ["main", "measure", "Stack"]

MiB = 1 << 20


class Stack(nn.Module):
    """Blocks in a ModuleList (one FSDP unit each) and a head left to the root unit."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(layers)
        )
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _local_bytes(t: Any) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tune_malloc() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: peak RSS follows live tensors
    except OSError:
        pass


def measure(sdp: int, width: int, layers: int, batch: int, steps: int, precision: str = "fp32") -> dict[str, Any]:
    """One rank's bytes for one degree (run inside run_ranks)."""
    import smp_compat as smp

    _tune_malloc()
    smp.init({"ddp": True, "sharded_data_parallel_degree": sdp, **({"bf16": True} if precision == "bf16" else {})})
    base = _peak_rss()
    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.bfloat16 if precision == "bf16" else None):
        module = Stack(width, layers)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    x = torch.randn(batch // smp.dp_size(), width)
    for _ in range(steps):
        opt.zero_grad()
        train_step(model, x)
        opt.step()
    return _state_bytes(list(model.parameters()), opt, base)


def measure_fsdp2(width: int, layers: int, batch: int, steps: int, precision: str) -> dict[str, Any]:
    """Plain FSDP2 over the whole world (sdp_throughput.plain_fsdp2: fp32 shards, the same policy), one rank."""
    import torch.distributed as dist
    from sdp_throughput import plain_fsdp2

    _tune_malloc()
    base = _peak_rss()
    torch.manual_seed(0)
    module = Stack(width, layers)  # fp32: what plain FSDP2 shards (smp upcasts its bf16 blocks one at a time)
    model = plain_fsdp2(module, precision, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch // dist.get_world_size(), width)
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return _state_bytes(list(model.parameters()), opt, base)


def _state_bytes(params: list[Any], opt: Any, base: int) -> dict[str, Any]:
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(v) for p in params for v in opt.state[p].values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),  # fmt: skip
        "full_params": sum(p.numel() * p.element_size() for p in params),
        "peak_rss_added": _peak_rss() - base,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    if ns.precision == "bf16":
        return _against_fsdp2(ns)
    results = {}
    for sdp in ns.degrees:
        ranks = run_ranks(measure, ns.world, sdp, ns.width, ns.layers, ns.batch, ns.steps, timeout=600,
                          env={"CUDA_VISIBLE_DEVICES": ""})  # CPU ranks: peak RSS is the measure
        results[sdp] = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the fullest rank
    base = results[ns.degrees[0]]
    table = Table(title=f"Per-rank model state, world {ns.world}, {base['full_params'] / MiB:.1f} MiB of parameters")
    for col in ("sdp", "params MiB", "grads MiB", "optimizer MiB", "state / sdp=1", "target", "peak RSS added MiB"):
        table.add_column(col, justify="right")
    ok = True
    for sdp, r in results.items():
        state = r["params"] + r["grads"] + r["optimizer"]
        ratio = state / (base["params"] + base["grads"] + base["optimizer"])
        target = 1 / sdp * 1.05 if ns.degrees[0] == 1 else float("nan")
        ok &= not ratio > target
        table.add_row(str(sdp), f"{r['params'] / MiB:.2f}", f"{r['grads'] / MiB:.2f}", f"{r['optimizer'] / MiB:.2f}",
                      f"{ratio:.3f}", f"<= {target:.3f}", f"{r['peak_rss_added'] / MiB:.1f}")  # fmt: skip
    Console().print(table)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(ns), "results": {str(k): v for k, v in results.items()}}, handle, indent=2)
    return 0 if ok else 1


def _against_fsdp2(ns: argparse.Namespace) -> int:
    """bf16: smp_compat and plain FSDP2 at sdp = world, each in its own ranks (peak RSS per process)."""
    args = (ns.width, ns.layers, ns.batch, ns.steps)
    env = {"CUDA_VISIBLE_DEVICES": ""}
    smp_ranks = run_ranks(measure, ns.world, ns.world, *args, "bf16", timeout=600, env=env)
    plain_ranks = run_ranks(measure_fsdp2, ns.world, *args, "bf16", timeout=600, env=env)
    results = {name: {k: max(r[k] for r in ranks) for k in ranks[0]}
               for name, ranks in (("smp", smp_ranks), ("fsdp2", plain_ranks))}  # fmt: skip
    state = {name: r["params"] + r["grads"] + r["optimizer"] for name, r in results.items()}
    ratios = {"state": state["smp"] / state["fsdp2"],
              "peak_rss_added": results["smp"]["peak_rss_added"] / max(results["fsdp2"]["peak_rss_added"], 1)}
    table = Table(title=f"Per-rank memory, bf16, sdp = world {ns.world}, "
                        f"{results['smp']['full_params'] / MiB:.1f} MiB of fp32 parameters")  # fmt: skip
    for col in ("variant", "params MiB", "grads MiB", "optimizer MiB", "state / fsdp2", "peak RSS added MiB"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['params'] / MiB:.2f}", f"{r['grads'] / MiB:.2f}", f"{r['optimizer'] / MiB:.2f}",
                      f"{state[name] / state['fsdp2']:.3f}", f"{r['peak_rss_added'] / MiB:.1f}")  # fmt: skip
    Console().print(table)
    print(f"smp / plain FSDP2 per-rank state: {ratios['state']:.3f}, peak RSS added: {ratios['peak_rss_added']:.3f} "
          "(target <= 1.05)")  # fmt: skip
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(ns), "results": results, "ratios": ratios}, handle, indent=2)
    return 0 if ratios["state"] <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
