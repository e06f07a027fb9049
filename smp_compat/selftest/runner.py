"""Run the checks on every rank and report them on rank 0, without letting one rank's failure hang the others.

Outcomes travel through the job's key-value store, not collectives: a check that failed on one rank can
leave the others blocked in a collective or a pipeline wait, and the store still works then. A collector
thread on rank 0 waits for every rank's outcome of a check; once one rank reports a failure (or torchrun
stops the job because a rank died), it waits a short grace for the rest, and a rank still silent then
died or hangs: it is named, the report is printed, and the job ends (rank 0 exits 1, the others' watch
threads end them). Otherwise the collector lets every rank start the next check.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from smp_compat import failure
from smp_compat.errors import RemoteError, SMPTimeoutError
from smp_compat.selftest.checks import Check, Context, Skipped
from smp_compat.selftest.faults import Injector
from smp_compat.selftest.report import (
    CheckReport,
    Outcome,
    merge,
    not_run,
    print_environment,
    print_table,
    to_json,
    write_json,
)

__all__ = ["GRACE_SECONDS", "run_battery"]

_PREFIX = "smp_compat/selftest/"
GRACE_SECONDS = 8.0
"""How long the others may take to report a check once one rank failed it (a pipeline peer waits 2 s for
news of a failure before it reports a lost connection; a busy host may delay a healthy rank a few seconds)."""
_POLL_SECONDS = 0.05


def _key(*parts: object) -> str:
    return _PREFIX + "/".join(str(p) for p in parts)


# ---------------------------------------------------------------- one check on this rank


def run_one(check: Check, ctx: Context) -> Outcome:
    """Run ``check`` here, timed; its error becomes a FAIL outcome (smp is reset either way)."""
    rank, start = ctx.rank, time.perf_counter()
    injector = Injector(ctx.faults, check.name, rank)
    try:
        result = check.run(ctx, injector)
    except Skipped as exc:
        return Outcome(rank, "SKIP", time.perf_counter() - start, detail=str(exc))
    except Exception as exc:  # noqa: BLE001 - a check's error is its result
        traceback.print_exc(file=sys.stderr)
        return Outcome(rank, "FAIL", time.perf_counter() - start, detail=failure.summary(exc), kind=_kind(exc))
    finally:
        _reset(ctx)
    measured, tol = result.measured, result.tolerance
    status = "PASS" if measured.problem is None else "FAIL"
    return Outcome(rank, status, time.perf_counter() - start, measured.worst, tol.rtol, tol.atol, result.layout,
                   measured.problem, None if status == "PASS" else "mismatch", measured.diverged_at,
                   result.links)  # fmt: skip


def _kind(exc: BaseException) -> str:
    """"echo" for an error that only repeats another rank's failure (its error passed on, a lost connection),
    so the report names the rank where it began; a pipeline timeout names where a message went missing."""
    if isinstance(exc, SMPTimeoutError):
        return "error"
    echoed = isinstance(exc, RemoteError) or getattr(exc, "_smp_raised_on", None) is not None
    return "echo" if echoed or failure.looks_like_lost_peer(exc) else "error"


def _reset(ctx: Context) -> None:
    try:
        ctx.smp.reset()
    except Exception:  # noqa: BLE001 - after a failed check the pipeline may not close cleanly; the next init is fresh
        traceback.print_exc(file=sys.stderr)


# ---------------------------------------------------------------- rank 0's collector


class _Collector:
    """Rank 0's thread: gathers each check's outcomes from the store, lets the ranks go on or ends the job."""

    def __init__(self, store: Any, ctx: Context, checks: list[Check], json_path: str | None, timeout: float) -> None:
        self.store, self.ctx, self.checks = store, ctx, checks
        self.json_path, self.timeout = json_path, timeout
        self.rows: list[CheckReport] = []
        self.started = time.perf_counter()
        self.stopping = threading.Event()  # torchrun sent SIGTERM: a rank died, the job is being stopped
        self.thread = threading.Thread(target=self._run, name="smp-selftest-collector", daemon=True)

    def _run(self) -> None:
        for index, check in enumerate(self.checks):
            outcomes, waited = self._gather(index)
            row = merge(check.name, check.about, outcomes, self.ctx.env.world_size, waited)
            self.rows.append(row)
            _progress(index, len(self.checks), row)
            if len(outcomes) < self.ctx.env.world_size:
                self._abort(index, check)
            self.store.set(_key(index, "go"), "next")

    def _gather(self, index: int) -> tuple[dict[int, Outcome], float]:
        world = self.ctx.env.world_size
        keys = [_key(index, rank) for rank in range(world)]
        start = time.monotonic()
        deadline, grace_end = start + self.timeout, None
        while not self.store.check(keys):
            now = time.monotonic()
            if grace_end is None and (self.store.add(_key(index, "failed"), 0) > 0 or self.stopping.is_set()):
                grace_end = now + GRACE_SECONDS
            if now >= (grace_end if grace_end is not None else deadline):
                break
            time.sleep(_POLL_SECONDS)
        present = [(r, k) for r, k in enumerate(keys) if self.store.check([k])]
        outcomes = {r: Outcome.from_text(self.store.get(k).decode()) for r, k in present}
        return outcomes, time.monotonic() - start

    def _abort(self, index: int, check: Check) -> None:
        """A rank gave no outcome: report what is known and end the job now (the silent rank may never return)."""
        self.rows += [not_run(c.name, c.about, check.name) for c in self.checks[index + 1 :]]
        self.finish()
        self.store.set(_key("abort"), "1")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def finish(self) -> int:
        """Print the table, write the JSON report; the exit status."""
        seconds = time.perf_counter() - self.started
        print_table(self.rows, seconds)
        if self.json_path:
            write_json(self.json_path, to_json(self.ctx.env, self.rows, seconds))
        sys.stdout.flush()
        return 1 if any(r.status == "FAIL" for r in self.rows) else 0


def _progress(index: int, total: int, row: CheckReport) -> None:
    seconds = f" {row.seconds:.1f} s" if row.seconds is not None else ""
    detail = f": {row.reason}" if row.status != "PASS" and row.reason else ""
    print(f"smp-compat selftest: [{index + 1}/{total}] {row.name} {row.status}{seconds}{detail}", file=sys.stderr,
          flush=True)  # fmt: skip


# ---------------------------------------------------------------- every rank


def _watch_abort(store: Any, rank: int, done: threading.Event) -> None:
    """Other ranks: end this process when rank 0 ended the job (its main thread may be blocked in a collective)."""
    while not done.wait(4 * _POLL_SECONDS):
        try:
            if not store.check([_key("abort")]):
                continue
        except Exception:  # noqa: BLE001 - the store went away with rank 0: the job is over
            pass
        print(f"smp-compat selftest: stopping rank {rank}: the selftest failed (rank 0 has the report)",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(1)


def _wait_go(store: Any, index: int) -> None:
    key = _key(index, "go")
    while not store.check([key]):
        time.sleep(_POLL_SECONDS / 2)


def _keep_running_on_sigterm(collector: _Collector) -> Callable[..., None]:
    """torchrun stops every rank (SIGTERM) when one dies: rank 0 finishes its report first (within the grace)."""

    def handler(signum: int, frame: Any) -> None:
        collector.stopping.set()

    return handler


def run_battery(ctx: Context, checks: list[Check], json_path: str | None, timeout: float) -> int:
    """Run ``checks`` in order on this rank; rank 0 prints the environment and the report. The exit status."""
    store = failure.default_store()
    collector = None
    if ctx.rank == 0:
        print_environment(ctx.env)
        sys.stdout.flush()
        collector = _Collector(store, ctx, checks, json_path, timeout)
        previous = signal.signal(signal.SIGTERM, _keep_running_on_sigterm(collector))
        collector.thread.start()
    done = threading.Event()
    watch = threading.Thread(target=_watch_abort, args=(store, ctx.rank, done), name="smp-selftest-abort", daemon=True)
    if collector is None:
        watch.start()
    for index, check in enumerate(checks):
        outcome = run_one(check, ctx)
        store.set(_key(index, ctx.rank), outcome.to_text())
        if outcome.status == "FAIL":
            store.add(_key(index, "failed"), 1)
        _wait_go(store, index)
    if collector is None:
        done.set()  # joined: a thread still inside a store call when the interpreter exits aborts the process
        watch.join()
        return 0
    collector.thread.join()
    signal.signal(signal.SIGTERM, previous)
    return collector.finish()
