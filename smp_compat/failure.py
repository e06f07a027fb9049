"""Job-wide failure propagation: one rank's error stops every rank within seconds, never a hang.

A failing rank writes its error into the process group's key-value store; every rank runs a small
watch thread that polls the store and, when another rank has failed, prints one line naming that
rank and its error and ends the process. Collective timeouts alone would take many minutes.

The line leads with the root exception (for a ``RemoteError``: the original exception, its rank and
module), and every rank that ends this way writes torch elastic's error file, so that torchrun's
closing summary names the cause too: ``RootCause`` travels with a ``RemoteError`` (rank, module,
microbatch, phase), and the failing ranks write ``TORCHELASTIC_ERROR_FILE`` (the JSON torch elastic's
``ErrorHandler`` writes), so torchrun's "Root Cause" shows it instead of ``error_file: <N/A>``.

A rank that dies of a lost connection (a collective's peer went away: gloo's "Connection reset by
peer", a pipeline timeout) first looks for the failure of the peer that went away and, finding one,
stops because of it instead of publishing its own, secondary error. A rank that leaves without an
uncaught exception is named too: ``exiting`` (run at exit while the job's process group is still up and
``smp.shutdown`` was not called) publishes ``rank N exited with status S before the job finished`` for
a non-zero ``sys.exit`` status, and only notes a status-0 exit, which a rank that then loses its
connection names as the cause (a clean end of every rank stays silent). A killed rank cannot publish.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist

from smp_compat.errors import RemoteError

__all__ = [
    "start_watch", "stop_watch", "publish", "publish_exception", "peer_failure", "stop_because", "POLL_SECONDS",
    "exiting", "looks_like_lost_peer", "portable", "raised_elsewhere", "stop_if_echo",
    "ERROR_FILE_ENV", "RootCause", "root_of", "summary", "write_error_file", "default_store",
]  # fmt: skip

_FAILURE_KEY = "smp_compat/failure"
_EXITED_KEY = "smp_compat/exited"  # a status-0 (or unknown) exit: named only when a peer then loses its connection
POLL_SECONDS = 0.25
_GRACE_SECONDS = 1.0
_EXIT_GRACE_SECONDS = 2.0  # a rank that exits runs smp.shutdown and its atexit handlers first: let it finish
_EXIT_CODE = 17


class _Watch:
    def __init__(self) -> None:
        self.rank = 0
        self.store: Any = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.published = False
        self.previous_hook: Any = None
        self.previous_exit: Any = None
        self.exit_status: int | None = None  # what this process passed to sys.exit, when it did


_watch = _Watch()


def start_watch(rank: int) -> None:
    """Start polling for other ranks' failures and publish this rank's uncaught exceptions."""
    store = default_store()
    if store is None or _watch.thread is not None:
        return
    _watch.rank, _watch.store, _watch.published = rank, store, False
    _watch.stop.clear()
    _watch.thread = threading.Thread(target=_poll, name="smp-failure-watch", daemon=True)
    _watch.thread.start()
    _watch.previous_hook = sys.excepthook
    sys.excepthook = _excepthook
    _watch.exit_status = None
    _watch.previous_exit = sys.exit
    sys.exit = _exit


def stop_watch() -> None:
    """Stop the watch thread (at shutdown or reset)."""
    thread = _watch.thread
    if thread is None:
        return
    _watch.stop.set()
    thread.join(timeout=2 * POLL_SECONDS + 1)
    _watch.thread = None
    _watch.store = None
    if sys.excepthook is _excepthook:
        sys.excepthook = _watch.previous_hook or sys.__excepthook__
    if sys.exit is _exit:
        sys.exit = _watch.previous_exit


def publish(message: str) -> None:
    """Tell every rank that this rank failed with ``message`` (first failure wins; best effort)."""
    store = _watch.store
    if store is None or _watch.published:
        return
    _watch.published = True
    _set_first(store, _FAILURE_KEY, _failure_note(_watch.rank, message))


def _failure_note(rank: int, message: str) -> str:
    """A failure as published for the other ranks, and as a stopping rank names it."""
    return f"rank {rank}: {message}"


def _set_first(store: Any, key: str, value: str) -> None:
    """``key`` = ``value`` unless some rank set it first (best effort)."""
    try:
        store.compare_set(key, "", value)
    except Exception:  # noqa: BLE001 - the store may be gone already; nothing else to do
        pass


def publish_exception(exc: BaseException) -> None:
    """Publish an exception's one-line summary (the root exception's type and message, rank and module)."""
    publish(summary(exc))


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """An uncaught error: tell the others, print it, and exit now, so launchers report this rank first.

    A lost connection (a collective's peer went away) is usually another rank's failure or early exit:
    when one is published, this rank stops because of it, with one line, instead of reporting its own.
    """
    stop_if_echo(exc)
    publish_exception(exc)
    root = root_of(exc, _watch.rank)
    details = "".join(traceback.format_exception(kind, exc, tb)).rstrip()
    write_error_file(root.line(), f"{details}\n\nsmp_compat: rank {_watch.rank} failed: {root.line()}")
    (_watch.previous_hook or sys.__excepthook__)(kind, exc, tb)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def stop_if_echo(exc: BaseException) -> None:
    """An uncaught error that echoes another rank's failure (a lost connection, or a failed pipeline step's
    copy): when that rank's failure is published, stop because of it (exit 17) instead of reporting this one."""
    if _raised_elsewhere(exc):  # the failed step's copy carries its origin's error: no need to wait for it
        # (the origin publishes it only on its way out, and a launcher may end this rank right then)
        origin = exc._smp_raised_on  # type: ignore[attr-defined]
        cause = peer_failure(0.0, exits=False) or _failure_note(origin, summary(exc))
    elif looks_like_lost_peer(exc):
        cause = _peer_cause(wait=2.0)
    else:
        return
    if cause is not None:
        _record_stop(cause)
        time.sleep(_grace(cause))  # as the watch does: launchers report the first exit as the cause
        stop_because(cause)


def raised_elsewhere(exc: BaseException, origin: int, rank: int) -> None:
    """Mark a step's error that ``rank`` raises because rank ``origin`` raised it first (a failed pipeline step):
    uncaught here too, it stops this rank because of ``origin``'s failure instead of being reported twice."""
    exc.add_note(f"(raised on rank {origin}; rank {rank} ended the same step with it)")
    exc._smp_raised_on = origin  # type: ignore[attr-defined]


def portable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling (another rank then raises the same type), else a RemoteError."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any error type the user defined
        return RemoteError(f"{type(exc).__name__}: {exc}")


def _raised_elsewhere(exc: BaseException) -> bool:
    return getattr(exc, "_smp_raised_on", None) is not None


def _poll() -> None:
    store = _watch.store
    while not _watch.stop.wait(POLL_SECONDS):
        try:
            if not store.check([_FAILURE_KEY]):
                continue
            message = store.get(_FAILURE_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001 - store gone (rank 0 exited): stop watching quietly
            return
        if not message or _is_own(message):
            continue
        _record_stop(message)  # first: a launcher that ends this rank during the grace still shows why
        time.sleep(_grace(message))  # let the failed rank exit first: launchers report the first exit as the cause
        stop_because(message)


def _grace(message: str) -> float:
    """How long a stopping rank waits for the rank that ``message`` names to end first."""
    return _EXIT_GRACE_SECONDS if _EXIT_NOTE.match(message) else _GRACE_SECONDS


def _is_own(message: str) -> bool:
    """Whether a stored message names this rank (``rank 3: ...`` or ``rank 3 exited ...``)."""
    return message.startswith((f"rank {_watch.rank}:", f"rank {_watch.rank} "))


def _read(store: Any, key: str) -> str | None:
    """Another rank's message under ``key``, if any (raises when the store is gone)."""
    if not store.check([key]):
        return None
    message = store.get(key).decode(errors="replace")
    return message if message and not _is_own(message) else None


def peer_failure(wait: float, exits: bool = False) -> str | None:
    """Another rank's published failure, waiting up to ``wait`` s for it (a lost connection often means one).

    With ``exits``, a peer's noted exit (``rank N exited with status 0 before the job finished``) counts
    too, when no failure is published: after a lost connection, it is why the connection was lost.
    """
    store = _watch.store
    deadline = time.monotonic() + wait
    while store is not None:
        try:
            message = _read(store, _FAILURE_KEY) or (_read(store, _EXITED_KEY) if exits else None)
        except Exception:  # noqa: BLE001 - store gone with the rank that hosted it
            return None
        if message is not None:
            return message
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_SECONDS / 5)
    return None


def _peer_cause(wait: float) -> str | None:
    """The peer failure or early exit behind a lost connection; an exit is published as the job's failure."""
    cause = peer_failure(wait, exits=True)
    store = _watch.store
    if cause is not None and store is not None and _EXIT_NOTE.match(cause):
        _watch.published = True
        _set_first(store, _FAILURE_KEY, cause)  # the other ranks' watches stop them too
    return cause


_EXIT_NOTE = re.compile(r"rank \d+ exited\b")


_LOST_PEER_TEXT = (
    "connection reset", "connection closed", "connection refused", "broken pipe", "socket closed",
    "timed out", "timeout", "gloo", "nccl", "remote process exited",
)  # fmt: skip


def looks_like_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) looks like a collective or connection whose peer went away."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError, _dist_error_types())):
            return True
        if isinstance(current, RuntimeError) and not getattr(current, "root", None):
            text = str(current).lower()
            if any(marker in text for marker in _LOST_PEER_TEXT):
                return True
        current = current.__cause__ or current.__context__
    return False


def _dist_error_types() -> tuple[type[BaseException], ...]:
    return tuple(t for t in (getattr(dist, "DistError", None),) if isinstance(t, type))


# ---------------------------------------------------------------- a rank that leaves without an exception
def _exit(status: Any = None) -> None:
    """``sys.exit`` while the watch runs: remember the status (``exiting`` names it), then exit as usual."""
    if threading.current_thread() is threading.main_thread():  # elsewhere it ends only that thread
        _watch.exit_status = _status_code(status)
    _watch.previous_exit(status)


def _status_code(status: Any) -> int:
    """The process exit status ``sys.exit(status)`` gives: None is 0, an int itself, anything else 1."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def exiting() -> None:
    """At exit, while the job's process group is still up and ``smp.shutdown`` was not called: say so.

    A non-zero ``sys.exit`` status is published as this rank's failure (the others' watches stop them,
    naming this rank); a status-0 (or unknown) exit is only noted, so a clean end of every rank stays
    silent, and a rank whose collective then loses this rank names it instead of a raw connection error.
    """
    store = _watch.store
    if store is None or _watch.published or _watch.thread is None:
        return
    try:
        if not dist.is_initialized() or dist.get_world_size() <= 1:
            return
    except (RuntimeError, ValueError):
        return
    status = _watch.exit_status
    how = f"exited with status {status}" if status is not None else "exited"
    line = f"rank {_watch.rank} {how} before the job finished"
    if status:
        _watch.published = True
        _set_first(store, _FAILURE_KEY, line)
        write_error_file(line, f"smp_compat: {line}")
    else:
        _set_first(store, _EXITED_KEY, line)


def _record_stop(message: str) -> str:
    """torch elastic's error file for a rank stopped because of ``message``; returns the stopping line."""
    line = f"smp_compat: stopping rank {_watch.rank} because {message.splitlines()[0]}"
    write_error_file(line, line, secondary=True)
    return line


def stop_because(message: str) -> None:
    """End this rank with one line naming the rank that failed and the root exception (exit code 17)."""
    sys.stderr.write(_record_stop(message) + "\n")
    sys.stderr.flush()
    os._exit(_EXIT_CODE)


# ---------------------------------------------------------------- the root cause, for people and launchers
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


@dataclass(frozen=True)
class RootCause:
    """An exception raised on ``rank`` (inside ``module`` when a pipeline call ran it), as plain strings."""

    kind: str
    message: str
    rank: int
    module: str | None = None
    context: str = ""

    def line(self) -> str:
        """``ValueError: boom [raised on rank 1 in module 'faulty', microbatch 0, forward]``."""
        where = f"raised on rank {self.rank}"
        if self.module:
            where += f" in module {self.module!r}"
        if self.context:
            where += f", {self.context}"
        text = f"{self.kind}: {self.message}" if self.message else self.kind
        return f"{text} [{where}]"


def root_of(exc: BaseException, rank: int, module: str | None = None, context: str = "") -> RootCause:
    """The root cause ``exc`` already carries (a ``RemoteError`` passed on), else ``exc`` itself on ``rank``."""
    carried = getattr(exc, "root", None)
    if isinstance(carried, RootCause):
        return carried
    return RootCause(_type_name(exc), _first_line(exc), rank, module, context)


def summary(exc: BaseException) -> str:
    """One line: the carried root cause when there is one, else ``Type: first line of the message``."""
    carried = getattr(exc, "root", None)
    if isinstance(carried, RootCause):
        return carried.line()
    message = _first_line(exc)
    return f"{_type_name(exc)}: {message}" if message else _type_name(exc)


def write_error_file(message: str, details: str, secondary: bool = False) -> None:
    """torch elastic's error file, when the launcher asked for one: ``message`` and a ``details`` traceback.

    torchrun prints ``details`` (``py_callstack``) under "Root Cause"; best effort, never raises. Its
    "Root Cause" is the failure with the smallest timestamp, in whole seconds; a ``secondary`` failure
    (a rank stopped because of another) is dated a second later, so that it never wins a tie.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    stamp = int(time.time()) + (1 if secondary else 0)
    data = {"message": {"message": message, "extraInfo": {"py_callstack": details, "timestamp": str(stamp)}}}
    try:
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError:
        pass


def _type_name(exc: BaseException) -> str:
    """As tracebacks print it: ``ValueError``, ``smp_compat.errors.RemoteError``."""
    kind = type(exc)
    module = kind.__module__
    return kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"


def _first_line(exc: BaseException) -> str:
    lines = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    head = lines[0] if lines else ""
    prefix = f"{_type_name(exc)}: "
    return head[len(prefix) :] if head.startswith(prefix) else ("" if head == _type_name(exc) else head)


def default_store() -> Any:
    """The key-value store of the default process group (used to broadcast a failure to every rank)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
