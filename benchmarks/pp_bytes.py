"""pp = 2 bytes moved per microbatch against the bytes that must cross the partition boundary.

Two models, each in its own 2-rank job (SMP allows one DistributedModel per process): the 4|4 MLP of the
throughput benchmark, and the TinyTransformer of ``tests/models.py`` with the manual split of
``tests/runtime/test_pp_fidelity.py`` (embedding, blocks 0-1 and the tied head on rank 0; blocks 2-3 and ln_f on
rank 1). Every message the pipeline engine sends is tallied by kind (payload bytes, headers excluded) over
steps after the first two (the engine learns on the first step which results are only passed on). The
end-of-step message that hands the step's outputs to the other ranks is counted apart: it is per step.

    python benchmarks/pp_bytes.py [--width 1024 --batch 512 --microbatches 8 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))  # tests/models.py: the shared TinyTransformer

import smp_compat as smp  # noqa: E402
from pp_workload import SmpRunner, make_batches, preload  # noqa: E402

__all__ = ["ModelResult", "Result", "main", "parse_args", "run"]

TARGET = 1.1
PER_STEP_KINDS = ("end_step",)


@dataclass
class ModelResult:
    """One model's traffic: tallies per message kind, and what must cross per microbatch (derived by hand)."""

    name: str
    microbatches: int
    steps: int
    by_kind: dict[str, list[int]]  # kind -> [payload bytes, messages], both ranks, all measured steps
    bytes_sent_delta: int  # engine.bytes_sent over the same steps, both ranks: must equal the tallies' sum
    must_cross: int  # bytes per microbatch that have to cross the boundary under SMP semantics
    must_cross_note: str
    boundary_only: int | None = None  # bytes per microbatch a loss-on-the-last-stage library must move

    def per_microbatch(self) -> float:
        moved = sum(b for kind, (b, _) in self.by_kind.items() if kind not in PER_STEP_KINDS)
        return moved / (self.steps * self.microbatches)

    def messages_per_microbatch(self) -> float:
        sent = sum(n for kind, (_, n) in self.by_kind.items() if kind not in PER_STEP_KINDS)
        return sent / (self.steps * self.microbatches)

    def per_step(self) -> float:
        return sum(self.by_kind.get(kind, [0, 0])[0] for kind in PER_STEP_KINDS) / self.steps

    @property
    def ratio(self) -> float:
        return self.per_microbatch() / self.must_cross


@dataclass
class Result:
    """Both models' traffic and the arguments they ran with."""

    args: dict[str, Any]
    models: list[ModelResult]

    @property
    def met(self) -> bool:
        return all(m.ratio <= TARGET for m in self.models)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the MLP of the throughput benchmark and the test suite's TinyTransformer."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024, help="MLP hidden width")
    p.add_argument("--layers", type=int, default=8, help="MLP Linear layers, split in half")
    p.add_argument("--batch", type=int, default=512, help="MLP samples per step")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (both models)")
    p.add_argument("--tf-batch", type=int, default=64, help="TinyTransformer sequences per step")
    p.add_argument("--tf-seq", type=int, default=8, help="TinyTransformer sequence length")
    p.add_argument("--tf-width", type=int, default=16, help="TinyTransformer model width d")
    p.add_argument("--steps", type=int, default=3, help="measured steps, after two unmeasured ones")
    p.add_argument("--timeout", type=float, default=300.0, help="hard limit for each 2-rank job, seconds")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    args = p.parse_args(argv)
    for batch in (args.batch, args.tf_batch):
        if batch % args.microbatches:
            p.error(f"batch {batch} must be divisible by --microbatches ({args.microbatches})")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    return args


# ---------------------------------------------------------------------- inside each rank
def _tally_sends(engine: Any) -> dict[str, list[int]]:
    """Wrap this rank's transport so every message is counted by kind before it is queued."""
    tally: dict[str, list[int]] = {}
    transport = engine.transport
    original = transport.send

    def counting_send(dst: int, kind: str, meta: Any = None, tensors: Any = (), *rest: Any, **kw: Any) -> Any:
        entry = tally.setdefault(kind, [0, 0])
        entry[0] += sum(t.numel() * t.element_size() for t in tensors)
        entry[1] += 1
        return original(dst, kind, meta, tensors, *rest, **kw)

    transport.send = counting_send
    return tally


def _measure(engine_of: Any, step: Any, batches: list, steps: int) -> dict[str, Any]:
    """Two unmeasured steps (partitioning, then learning which results stay remote), then tally ``steps``."""
    for i in range(2):
        step(*batches[i % len(batches)])
    dist.barrier()
    engine = engine_of()
    tally = _tally_sends(engine)
    before = engine.bytes_sent
    for i in range(steps):
        step(*batches[i % len(batches)])
    dist.barrier()
    return {"tally": tally, "delta": engine.bytes_sent - before}


def _mlp_rank(args: argparse.Namespace) -> dict[str, Any]:
    """The throughput benchmark's MLP and step (loss in the step body on rank 0), interleaved."""
    runner = SmpRunner.create(args.width, args.layers, args.microbatches)
    return _measure(lambda: runner.model.pipeline_engine, runner.step, make_batches(args.width, args.batch), args.steps)


def _transformer_rank(args: argparse.Namespace) -> dict[str, Any]:
    """tests/models.py's TinyTransformer, placed as tests/runtime/test_pp_fidelity.py places it at pp = 2."""
    from models import causal_mask, lm_loss, make_model
    from models import make_batches as token_batches

    smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    model = smp.DistributedModel(make_model(d=args.tf_width, seq=args.tf_seq))
    blocks = model.module.blocks
    for i, block in enumerate(blocks):  # tests/runtime/test_pp_fidelity.py's _place_manually at pp = 2
        smp.set_partition(block, min(i // (len(blocks) // 2), 1))
    smp.set_partition(model.module.ln_f, 1)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    mask = causal_mask(args.tf_seq)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        train_step(model, x, y)
        optimizer.step()

    batches = token_batches(2, args.tf_batch, seq=args.tf_seq)
    return _measure(lambda: model.pipeline_engine, step, batches, args.steps)


# ---------------------------------------------------------------------- in the parent
def _merge(per_rank: list[dict[str, Any]]) -> tuple[dict[str, list[int]], int]:
    """Both directions: the sum over ranks of each kind's tally, and of the bytes_sent deltas."""
    by_kind: dict[str, list[int]] = {}
    for rank in per_rank:
        for kind, (nbytes, count) in rank["tally"].items():
            entry = by_kind.setdefault(kind, [0, 0])
            entry[0] += nbytes
            entry[1] += count
    return by_kind, sum(rank["delta"] for rank in per_rank)


def run(args: argparse.Namespace) -> Result:
    """One 2-rank job per model; what must cross is derived by hand (see the docstring and the README)."""
    from smp_compat.testing import run_ranks

    preload()
    m = args.microbatches
    act = args.batch // m * args.width * 4
    by_kind, delta = _merge(run_ranks(_mlp_rank, 2, args, timeout=args.timeout))
    mlp = ModelResult(
        f"MLP {args.layers // 2}|{args.layers - args.layers // 2}, width {args.width}, batch {args.batch}",
        m, args.steps, by_kind, delta, must_cross=4 * act, boundary_only=2 * act,
        must_cross_note=f"h to rank 1, output back (the loss is in the step body on rank 0), their two "
        f"gradients: 4 x {args.batch // m} x {args.width} x 4 B",
    )  # fmt: skip
    hidden = args.tf_batch // m * args.tf_seq * args.tf_width * 4
    mask = args.tf_seq * args.tf_seq * 4
    by_kind, delta = _merge(run_ranks(_transformer_rank, 2, args, timeout=args.timeout))
    tf = ModelResult(
        f"TinyTransformer blocks 2|2 + ln_f on 1, d {args.tf_width}, seq {args.tf_seq}, batch {args.tf_batch}",
        m, args.steps, by_kind, delta, must_cross=4 * hidden + mask,
        must_cross_note=f"hidden to rank 1, ln_f output back, their two gradients: 4 x {args.tf_batch // m} x "
        f"{args.tf_seq} x {args.tf_width} x 4 B, + the attention mask once ({args.tf_seq}x{args.tf_seq} fp32)",
    )  # fmt: skip
    return Result(vars(args), [mlp, tf])


def report(result: Result, console: Console) -> None:
    """One row per model, with the derivation of what must cross in the caption."""
    table = Table(title=f"pp=2 bytes moved per microbatch (payload, both directions, {result.args['steps']} "
                        f"steps after 2 unmeasured, microbatches {result.args['microbatches']})")  # fmt: skip
    for col in ("model", "moved B/mb", "must cross B/mb", "moved / must", "msgs/mb", "end_step B/step",
                "by kind (B/mb)"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("model", "by kind (B/mb)") else "right")
    for m in result.models:
        n = m.steps * m.microbatches
        kinds = ", ".join(f"{k} {b / n:,.0f}" for k, (b, _) in sorted(m.by_kind.items()) if k not in PER_STEP_KINDS)
        table.add_row(m.name, f"{m.per_microbatch():,.0f}", f"{m.must_cross:,}", f"{m.ratio:.3f}",
                      f"{m.messages_per_microbatch():.2f}", f"{m.per_step():,.0f}", kinds)  # fmt: skip
    verdict = "[green](met)[/green]" if result.met else "[red](missed)[/red]"
    lines = [f"Target: moved / must cross <= {TARGET} {verdict}"]
    for m in result.models:
        lines.append(f"{m.name}: must cross = {m.must_cross_note}.")
        if m.boundary_only is not None:
            lines.append(f"  With the loss on the last stage (torch's structure) only {m.boundary_only:,} B/mb would "
                         f"cross: moved / that = {m.per_microbatch() / m.boundary_only:.3f}.")  # fmt: skip
        total = sum(b for b, _ in m.by_kind.values())
        if total != m.bytes_sent_delta:
            lines.append(f"  [red]tally {total:,} B != engine.bytes_sent delta {m.bytes_sent_delta:,} B[/red]")
    table.caption = "\n".join(lines)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    """Run both jobs, print, optionally write JSON; 0 when every model is within the target."""
    args = parse_args(argv)
    result = run(args)
    report(result, Console(width=max(Console().width, 160)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": result.args, "models": [asdict(m) for m in result.models]}, handle, indent=2)
    return 0 if result.met else 1


if __name__ == "__main__":
    raise SystemExit(main())
