"""What it costs to run one pipeline stage's microbatches on several threads instead of one.

smp_compat's pp_rank 0 runs each in-flight microbatch as a task on its own worker thread (a task that waits
for another rank keeps its thread), so its forward and backward products run on up to
``active_microbatches`` different threads. This probe, in one process bound to one core, runs rank 0's
work of one step (8 microbatches through 4 Linear + ReLU layers, in the 1F1B order of 4 in flight) handing
every forward and backward to a worker thread: all on one worker, or microbatch k on worker k % 4. The
hand-overs are the same in both; only the number of distinct threads differs.

    python benchmarks/thread_spread.py [--width 512 --rounds 20]

It prints the median ms/step of each and their ratio (four / one). It has no target: it measures a
design cost (per-thread state such as MKL's per-thread memory pools and malloc arenas going cold).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pp_workload import make_mlp, split_index  # noqa: E402

__all__ = ["Worker", "main", "parse_args", "step_order"]

MICROBATCHES, IN_FLIGHT, THREADS = 8, 4, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    p.add_argument("--microbatch", type=int, default=32, help="samples per microbatch")
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds (each runs both variants)")
    p.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    return p.parse_args(argv)


class Worker:
    """A thread that runs one function at a time for the caller, handed over with plain locks (as the engine)."""

    def __init__(self) -> None:
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._fn: Callable[[], None] | None = None
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        torch.set_num_threads(1)
        while True:
            self._go.acquire()
            if self._fn is None:
                return
            self._fn()
            self._done.release()

    def close(self) -> None:
        self._fn = None
        self._go.release()

    def run(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._go.release()
        self._done.acquire()


def step_order() -> list[tuple[str, int]]:
    """Rank 0's order with 4 in flight: four forwards, then backward k and forward k + 4, then the last backwards."""
    order = [("f", k) for k in range(IN_FLIGHT)]
    for k in range(MICROBATCHES - IN_FLIGHT):
        order += [("b", k), ("f", k + IN_FLIGHT)]
    return order + [("b", k) for k in range(MICROBATCHES - IN_FLIGHT, MICROBATCHES)]


def main(argv: list[str] | None = None) -> int:
    """Runs on one core and one torch thread, restoring both afterwards (the smoke test calls it in-process)."""
    args = parse_args(argv)
    cores, threads = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None), torch.get_num_threads()
    try:
        if cores:
            os.sched_setaffinity(0, {min(cores)})
        torch.set_num_threads(1)
        print(_measure(args))
    finally:
        if cores:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
    return 0


def _measure(args: argparse.Namespace) -> str:
    stage = make_mlp(args.width, 8)[: split_index(8)]  # rank 0's half: the first 4 Linear + ReLU
    optimizer = torch.optim.SGD(stage.parameters(), lr=1e-3, momentum=0.9)
    inputs = [torch.randn(args.microbatch, args.width) for _ in range(MICROBATCHES)]
    workers = [Worker() for _ in range(THREADS)]

    def step(threads: int) -> None:
        optimizer.zero_grad()
        outputs: list[torch.Tensor | None] = [None] * MICROBATCHES

        def forward(k: int) -> None:
            outputs[k] = stage(inputs[k])

        def backward(k: int) -> None:
            outputs[k].backward(torch.ones_like(outputs[k]))
            outputs[k] = None

        for kind, k in step_order():
            work = forward if kind == "f" else backward
            workers[k % threads].run(lambda: work(k))
        optimizer.step()

    times: dict[int, list[float]] = {1: [], THREADS: []}
    for _ in range(5):
        step(1), step(THREADS)
    for r in range(args.rounds):
        for threads in (1, THREADS) if r % 2 == 0 else (THREADS, 1):
            start = time.perf_counter()
            for _ in range(args.steps):
                step(threads)
            times[threads].append((time.perf_counter() - start) / args.steps * 1e3)
    for worker in workers:
        worker.close()
    one, spread = statistics.median(times[1]), statistics.median(times[THREADS])
    return (f"width {args.width}, microbatch {args.microbatch}: one worker {one:.2f} ms/step, {THREADS} workers "
            f"{spread:.2f} ms/step, ratio {spread / one:.3f}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
