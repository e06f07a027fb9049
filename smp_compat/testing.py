"""Run a function on N CPU ranks (gloo) with a hard timeout; report which rank failed and how.

Results travel as plain pickles (not torch shared-memory handles, which die with the child).
Ranks are forked (about 0.2 s for four, against 15-20 s with spawn) and meet through a file
rendezvous, so no port is needed. Used by our tests and benchmarks, and usable for yours.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["run_ranks", "RankFailure"]

_GRACE_SECONDS = 5.0


class RankFailure(AssertionError):
    """One or more ranks failed or timed out; the message has one paragraph per rank."""


@dataclass
class _Rank:
    rank: int
    process: Any
    conn: Connection
    outcome: tuple[str, Any] | None = None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` forked ranks with a gloo process group; return each rank's result.

    Inside ``fn`` the default process group is initialized and RANK/WORLD_SIZE/LOCAL_RANK are set, so
    ``smp.init(...)`` finds it. Raises RankFailure naming every rank that raised, exited or hung.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="smp_ranks_") as tmp:
        ranks = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=_child,
                args=(fn, args, rank, world_size, os.path.join(tmp, "rdzv"), dict(env or {}), child_end,
                      timeout, threads_per_rank),
                daemon=True,
            )
            process.start()
            child_end.close()
            ranks.append(_Rank(rank, process, parent_end))
        _collect(ranks, timeout)
    return _results_or_raise(ranks, timeout)


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    rdzv: str,
    env: dict[str, str],
    conn: Connection,
    timeout: float,
    threads: int,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(threads)
    code = 0
    try:
        # sys.__stderr__: under pytest's capsys, sys.stderr has no file descriptor for faulthandler.
        # A fatal signal (SIGSEGV, SIGABRT, ...) prints every thread's Python stack before the rank dies.
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
        faulthandler.dump_traceback_later(max(timeout - 1.0, 1.0), exit=False, file=sys.__stderr__)
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
        result = fn(*args)
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        _publish(exc)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        conn.send_bytes(pickle.dumps(("error", text)))
        code = 1
    finally:
        _teardown()
    os._exit(code)


def _publish(exc: BaseException) -> None:
    """As an uncaught error in a launched job: an echo of another rank's failure stops this rank (exit 17)."""
    from smp_compat import failure

    failure.stop_if_echo(exc)
    failure.publish_exception(exc)


def _teardown() -> None:
    import torch.distributed as dist

    from smp_compat.globalstate import reset
    from smp_compat.v2.state import reset as reset_v2

    try:
        reset()
        reset_v2()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is exiting anyway
        pass


def _collect(ranks: list[_Rank], timeout: float) -> None:
    """Wait for every rank; once one fails, give the others a short grace period, then kill."""
    deadline = time.monotonic() + timeout
    while any(r.outcome is None for r in ranks):
        now = time.monotonic()
        if now >= deadline:
            break
        for r in ranks:
            if r.outcome is None and r.conn.poll(0.02):
                r.outcome = _receive(r)
            elif r.outcome is None and not r.process.is_alive() and not r.conn.poll(0):
                r.outcome = ("exit", r.process.exitcode)
        if any(r.outcome and r.outcome[0] != "ok" for r in ranks):
            deadline = min(deadline, now + _GRACE_SECONDS)
    for r in ranks:
        r.process.join(timeout=0.5)
        if r.process.is_alive():
            r.process.kill()
            r.process.join()
        elif r.outcome is not None and r.outcome[0] == "ok" and (r.process.exitcode or 0) < 0:
            r.outcome = ("exit", r.process.exitcode)  # a result, then a crash while leaving: a failure too


def _receive(r: _Rank) -> tuple[str, Any]:
    try:
        return pickle.loads(r.conn.recv_bytes())
    except EOFError:
        r.process.join(timeout=1.0)
        return ("exit", r.process.exitcode)


def _exit_text(code: int | None) -> str:
    """How a rank that gave no result (or crashed after giving it) ended: its exit code, or the signal."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (its threads' Python stacks are printed above)"
    return f"exited with code {code} without a result"


def _results_or_raise(ranks: list[_Rank], timeout: float) -> list[Any]:
    if all(r.outcome and r.outcome[0] == "ok" for r in ranks):
        return [r.outcome[1] for r in ranks]  # type: ignore[index]
    lines = []
    for r in ranks:
        if r.outcome is None:
            lines.append(f"rank {r.rank}: did not finish within {timeout:.0f} s (killed; stack dump above)")
        elif r.outcome[0] == "error":
            lines.append(f"rank {r.rank} raised:\n{r.outcome[1]}")
        elif r.outcome[0] == "exit":
            lines.append(f"rank {r.rank}: {_exit_text(r.outcome[1])}")
    raise RankFailure("\n".join(lines))
