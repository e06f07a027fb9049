"""pp = 2 peak activation memory per rank: smp_compat "interleaved" against "simple" (and torch's schedules).

Method (deterministic, no allocator or RSS noise): every layer of the MLP runs under
``torch.autograd.graph.saved_tensors_hooks``; the pack hook adds each distinct saved tensor's bytes
(parameters excluded) to a per-rank counter and wraps the tensor in a small holder object, and a
``weakref.finalize`` on that holder subtracts the bytes when autograd drops the saved tensor (after
backward, or when the graph is freed). The counter's maximum during a step is the peak activation memory.
The hooks are entered inside each layer's forward, so they apply in whichever thread runs the layer
(smp_compat runs microbatches in task threads; saved-tensor hooks are thread-local).

    python benchmarks/pp_memory.py [--width 1024 --batch 512 --microbatches 8 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pp_workload import (  # noqa: E402
    SMP_VARIANTS,
    TORCH_VARIANTS,
    SmpRunner,
    TorchRunner,
    make_batches,
    make_mlp,
    preload,
    split_index,
)
from smp_compat.testing import run_ranks  # noqa: E402

__all__ = ["Result", "SavedTensorMeter", "main", "parse_args", "run"]

MiB = 1 << 20


class SavedTensorMeter:
    """Bytes of activations autograd currently holds for backward, and the maximum since ``reset_peak``."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._refs: dict[tuple[int, int], int] = {}  # (data_ptr, nbytes) -> live holders
        self._params: set[int] = set()
        self._lock = threading.Lock()

    class _Held:
        """What autograd keeps instead of the tensor; its death means the saved tensor was released."""

        __slots__ = ("tensor", "__weakref__")

        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def exclude_parameters(self, module: nn.Module) -> None:
        """Weights are saved for backward too, but they are not activations."""
        self._params |= {p.data_ptr() for p in module.parameters()}

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.data_ptr() in self._params or tensor.device.type == "meta":
            return tensor
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        # Detached: holding a saved *output* with its grad_fn would make a cycle through autograd's C++ graph
        # (node -> saved tensor -> grad_fn -> node) that Python's gc cannot break, and leak every graph.
        held = SavedTensorMeter._Held(tensor.detach())
        with self._lock:
            if self._refs.get(key, 0) == 0:
                self.current += key[1]
                self.peak = max(self.peak, self.current)
            self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, SavedTensorMeter._Held) else packed

    def _release(self, key: tuple[int, int]) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.current -= key[1]

    def instrument(self, model: nn.Sequential) -> nn.Sequential:
        """Run every child's forward under this meter's hooks (before smp_compat wraps the forwards)."""
        for child in model:
            child.forward = types.MethodType(_metered(self, child.forward), child)
        return model


def _metered(meter: SavedTensorMeter, forward: Callable[..., Any]) -> Callable[..., Any]:
    def metered_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            return forward(*args, **kwargs)

    return metered_forward


@dataclass
class Result:
    """Peak saved-activation bytes per variant and rank (max and min over the measured steps)."""

    args: dict[str, Any]
    peak_max: dict[str, list[int]]
    peak_min: dict[str, list[int]]
    unit_bytes: list[int]  # what one microbatch saves on each rank (measured with one microbatch in flight)
    residual: dict[str, list[int]]  # bytes still held after the step: must be 0 (nothing leaks)

    @property
    def met(self) -> bool:
        inter, simple = self.peak_max["smp-interleaved"], self.peak_max["smp-simple"]
        return all(i < s for i, s in zip(inter, simple))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; the defaults are issue 3's workload (activations dominate at this width)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=8, help="Linear layers, split in half between the two ranks")
    p.add_argument("--batch", type=int, default=512, help="samples per step")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant (after one unmeasured)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--timeout", type=float, default=600.0, help="hard limit for the 2-rank job, seconds")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    args = p.parse_args(argv)
    if args.batch % args.microbatches:
        p.error(f"--batch ({args.batch}) must be divisible by --microbatches ({args.microbatches})")
    if args.microbatches < 2 or args.steps < 1:
        p.error("--microbatches must be at least 2 and --steps at least 1")
    return args


# ---------------------------------------------------------------------- inside each rank
def _measure(meter: SavedTensorMeter, runner: Any, batches: list, steps: int) -> tuple[list[int], int]:
    """Peak saved bytes of each of ``steps`` steps (after one unmeasured), and what is still held after them."""
    runner.step(*batches[0])
    peaks = []
    for i in range(steps):
        dist.barrier()
        meter.reset_peak()
        runner.step(*batches[i % len(batches)])
        dist.barrier()
        peaks.append(meter.peak)
    return peaks, meter.current


def _unit_bytes(args: argparse.Namespace) -> int:
    """Activations one microbatch saves on this rank's half of the MLP, run locally without any pipeline."""
    cut = split_index(args.layers)
    full = make_mlp(args.width, args.layers)
    half = full[:cut] if dist.get_rank() == 0 else full[cut:]
    probe = SavedTensorMeter()
    probe.exclude_parameters(half)
    probe.instrument(half)
    x = torch.randn(args.batch // args.microbatches, args.width, requires_grad=dist.get_rank() == 1)
    out = half(x)  # keeps the graph, and so the saved tensors, alive while we read the counter
    saved = probe.current
    del out
    return saved


def _rank_main(args: argparse.Namespace) -> dict[str, Any]:
    """smp variants on the one DistributedModel (switched between steps), then each torch schedule.

    Weights are excluded by data pointer, taken before smp_compat partitions: on CPU the parameters this
    rank keeps stay where they are.
    """
    meter = SavedTensorMeter()
    net = meter.instrument(make_mlp(args.width, args.layers))
    meter.exclude_parameters(net)
    smp_runner = SmpRunner.create(args.width, args.layers, args.microbatches, module=net)
    batches = make_batches(args.width, args.batch)
    smp_runner.step(*batches[0])  # partitions the model
    peaks, residual = {}, {}
    for variant in SMP_VARIANTS:
        smp_runner.use(variant)
        peaks[variant], residual[variant] = _measure(meter, smp_runner, batches, args.steps)
    for variant in TORCH_VARIANTS:
        runner = TorchRunner.create(variant, args.width, args.layers, args.batch, args.microbatches)
        meter.instrument(runner.stage_module)
        meter.exclude_parameters(runner.stage_module)
        peaks[variant], residual[variant] = _measure(meter, runner, batches, args.steps)
    return {"peaks": peaks, "residual": residual, "unit": _unit_bytes(args)}


# ---------------------------------------------------------------------- in the parent
def run(args: argparse.Namespace) -> Result:
    """One 2-rank job; peaks per variant and rank."""
    preload()
    per_rank = run_ranks(_rank_main, 2, args, timeout=args.timeout, threads_per_rank=args.threads)
    variants = [*SMP_VARIANTS, *TORCH_VARIANTS]
    return Result(
        args=vars(args),
        peak_max={v: [max(r["peaks"][v]) for r in per_rank] for v in variants},
        peak_min={v: [min(r["peaks"][v]) for r in per_rank] for v in variants},
        unit_bytes=[r["unit"] for r in per_rank],
        residual={v: [r["residual"][v] for r in per_rank] for v in variants},
    )


def report(result: Result, console: Console) -> None:
    """One table: peak per variant and rank, in MiB and in microbatches' worth, with the target."""
    a = result.args
    table = Table(
        title=f"pp=2 peak activation memory (bytes saved for backward): MLP width {a['width']} x {a['layers']} "
        f"layers split {a['layers'] // 2}|{a['layers'] - a['layers'] // 2}, batch {a['batch']}, microbatches "
        f"{a['microbatches']}, {a['steps']} steps"
    )
    for col in ("variant", "rank 0 peak MiB", "rank 0 microbatches", "rank 1 peak MiB", "rank 1 microbatches",
                "after step"):  # fmt: skip
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v, peaks in result.peak_max.items():
        cells = []
        for rank, peak in enumerate(peaks):
            low = result.peak_min[v][rank]
            spread = "" if low == peak else f" (min {low / MiB:.2f})"
            cells += [f"{peak / MiB:.2f}{spread}", f"{peak / result.unit_bytes[rank]:.2f}"]
        table.add_row(v, *cells, "0" if not any(result.residual[v]) else str(result.residual[v]))
    inter, simple = result.peak_max["smp-interleaved"], result.peak_max["smp-simple"]
    verdict = "[green](met)[/green]" if result.met else "[red](missed)[/red]"
    table.caption = (
        f"Target: smp-interleaved peak < smp-simple peak on every rank: "
        f"{' / '.join(f'{i / s:.2f}' for i, s in zip(inter, simple))} of simple {verdict}. "
        f"microbatches = peak / what one microbatch saves on that rank "
        f"({result.unit_bytes[0] / MiB:.2f} / {result.unit_bytes[1] / MiB:.2f} MiB). Peak: max over steps "
        "(min shown when steps differ). after step: bytes still saved when the step returned."
    )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    """Run, print, optionally write JSON; 0 when interleaved peaks below simple on every rank."""
    args = parse_args(argv)
    result = run(args)
    report(result, Console(width=max(Console().width, 140)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(asdict(result), handle, indent=2)
    return 0 if result.met else 1


if __name__ == "__main__":
    raise SystemExit(main())
