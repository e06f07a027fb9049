"""What lockstep scheduling costs at pp = 2 x tp = 2 (4 gloo ranks), and what pipelining buys back.

Three variants of one job, run in alternating rounds (the order rotating) because timings on a shared
machine drift by tens of percent within a minute:

* ``lockstep-1``: one microbatch in flight (``active_microbatches`` 1), lockstep on;
* ``free-1``: the same schedule with lockstep off. With one microbatch in flight every tp peer runs
  the same order anyway, so this is the one configuration that is correct without lockstep: the
  ratio lockstep-1 / free-1 is lockstep's own cost (decision messages, followers waiting for them);
* ``lockstep-m``: ``active_microbatches`` = microbatches (the pipelined schedule, lockstep on), against
  which the first two show what a one-in-flight fallback would have cost.

    python benchmarks/pptp_lockstep.py [--hidden 256 --layers 4 --batch 32 --microbatches 4 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from smp_compat.testing import run_ranks

__all__ = ["main"]

VARIANTS = ("lockstep-1", "free-1", "lockstep-m")


def _model(smp: Any, hidden: int, layers: int, vocab: int, seq: int) -> torch.nn.Module:
    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = smp.nn.DistributedEmbedding(vocab, hidden)
            self.transformer = smp.nn.DistributedTransformer(
                num_layers=layers, num_attention_heads=4, attention_head_size=hidden // 4, hidden_size=hidden,
                intermediate_size=4 * hidden, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
                causal_mask_size=seq, pre_layernorm=True, post_layernorm=False)  # fmt: skip
            self.head = torch.nn.Linear(hidden, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h, _ = self.transformer((self.embedding(ids), None))
            return self.head(h)

    return LM()


def _job(args: argparse.Namespace) -> dict[str, Any]:
    import smp_compat as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
              "microbatches": args.microbatches, "auto_partition": False, "default_partition": 0})  # fmt: skip
    vocab, seq = 64, 32
    torch.manual_seed(0)
    model = smp.DistributedModel(_model(smp, args.hidden, args.layers, vocab, seq))
    for layer in list(model.get_module().transformer.seq_layers)[args.layers // 2 :]:
        smp.set_partition(layer, 1)
    smp.set_partition(model.get_module().head, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids.reshape(-1))
        model.backward(loss)
        return loss

    ids = torch.randint(0, vocab, (args.batch // smp.dp_size(), seq), generator=torch.Generator().manual_seed(1))

    def run(variant: str, steps: int) -> float:
        engine = model.pipeline_engine
        if engine is not None:  # between steps, on every rank alike
            lockstep = saved["lockstep"] if variant.startswith("lockstep") else None
            engine.lockstep = engine.scheduler.lockstep = lockstep
            active = args.microbatches if variant.endswith("-m") else 1
            engine.cfg = smp.state.cfg.model_copy(update={"active_microbatches": active})
        smp.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            train_step(ids)
            opt.step()
        smp.barrier()
        return (time.perf_counter() - start) / max(steps, 1)

    saved: dict[str, Any] = {}
    run("lockstep-m", 1)  # partitions
    saved["lockstep"] = model.pipeline_engine.lockstep
    for variant in VARIANTS:
        run(variant, args.warmup)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    published: dict[str, int] = {}
    for r in range(args.rounds):
        for variant in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            before = saved["lockstep"].published
            times[variant].append(run(variant, args.steps))
            published[variant] = (saved["lockstep"].published - before) // args.steps
    run("lockstep-m", 0)
    return {"times": times, "decisions_per_step": published, "leader": saved["lockstep"].leader,
            "pp_rank": smp.pp_rank()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="global batch (each tp rank brings batch / dp samples)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    results = run_ranks(_job, 4, args, timeout=1200)
    times = results[0]["times"]
    median = {v: statistics.median(t) for v, t in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["lockstep-1"], times["free-1"]))
    pipelined = statistics.median(a / b for a, b in zip(times["lockstep-1"], times["lockstep-m"]))
    print(f"pp=2 x tp=2, hidden {args.hidden}, layers {args.layers}, batch {args.batch}, m {args.microbatches}")
    for v in VARIANTS:
        print(f"  {v:11s} median step {median[v] * 1e3:8.1f} ms")
    for r in results:
        if r["leader"]:
            print(f"  tp leader of stage {r['pp_rank']}: decisions per step {r['decisions_per_step']}")
    print(f"lockstep cost (lockstep-1 / free-1, median of per-round ratios): {ratio:.3f}")
    print(f"pipelining (lockstep-1 / lockstep-m): {pipelined:.3f}x faster with {args.microbatches} in flight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
