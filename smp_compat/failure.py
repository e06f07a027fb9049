"""Job-wide failure propagation: one rank's error stops every rank within seconds, never a hang.

A failing rank writes its error into the process group's key-value store; every rank runs a small
watch thread that polls the store and, when another rank has failed, prints one line naming that
rank and its error and ends the process. Collective timeouts alone would take many minutes.

The line leads with the root exception (for a ``RemoteError``: the original exception, its rank and
module), and every rank that ends this way writes torch elastic's error file, so that torchrun's
closing summary names the cause too: ``RootCause`` travels with a ``RemoteError`` (rank, module,
microbatch, phase), and the failing ranks write ``TORCHELASTIC_ERROR_FILE`` (the JSON torch elastic's
``ErrorHandler`` writes), so torchrun's "Root Cause" shows it instead of ``error_file: <N/A>``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist

__all__ = [
    "start_watch", "stop_watch", "publish", "publish_exception", "peer_failure", "stop_because", "POLL_SECONDS",
    "ERROR_FILE_ENV", "RootCause", "root_of", "summary", "write_error_file", "default_store",
]  # fmt: skip

_FAILURE_KEY = "smp_compat/failure"
POLL_SECONDS = 0.25
_GRACE_SECONDS = 1.0
_EXIT_CODE = 17


class _Watch:
    def __init__(self) -> None:
        self.rank = 0
        self.store: Any = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.published = False
        self.previous_hook: Any = None


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


def publish(message: str) -> None:
    """Tell every rank that this rank failed with ``message`` (first failure wins; best effort)."""
    store = _watch.store
    if store is None or _watch.published:
        return
    _watch.published = True
    try:
        store.compare_set(_FAILURE_KEY, "", f"rank {_watch.rank}: {message}")
    except Exception:  # noqa: BLE001 - the store may be gone already; nothing else to do
        pass


def publish_exception(exc: BaseException) -> None:
    """Publish an exception's one-line summary (the root exception's type and message, rank and module)."""
    publish(summary(exc))


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """An uncaught error: tell the others, print it, and exit now, so launchers report this rank first."""
    publish_exception(exc)
    root = root_of(exc, _watch.rank)
    details = "".join(traceback.format_exception(kind, exc, tb)).rstrip()
    write_error_file(root.line(), f"{details}\n\nsmp_compat: rank {_watch.rank} failed: {root.line()}")
    (_watch.previous_hook or sys.__excepthook__)(kind, exc, tb)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def _poll() -> None:
    store = _watch.store
    while not _watch.stop.wait(POLL_SECONDS):
        try:
            if not store.check([_FAILURE_KEY]):
                continue
            message = store.get(_FAILURE_KEY).decode(errors="replace")
        except Exception:  # noqa: BLE001 - store gone (rank 0 exited): stop watching quietly
            return
        if not message or message.startswith(f"rank {_watch.rank}:"):
            continue
        _record_stop(message)  # first: a launcher that ends this rank during the grace still shows why
        time.sleep(_GRACE_SECONDS)  # let the failed rank exit first: launchers report the first exit as the cause
        stop_because(message)


def peer_failure(wait: float) -> str | None:
    """Another rank's published failure, waiting up to ``wait`` s for it (a lost connection often means one)."""
    store = _watch.store
    deadline = time.monotonic() + wait
    while store is not None:
        try:
            if store.check([_FAILURE_KEY]):
                message = store.get(_FAILURE_KEY).decode(errors="replace")
                if message and not message.startswith(f"rank {_watch.rank}:"):
                    return message
        except Exception:  # noqa: BLE001 - store gone with the rank that hosted it
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_SECONDS / 5)
    return None


def _record_stop(message: str) -> str:
    """torch elastic's error file for a rank stopped because of ``message``; returns the stopping line."""
    line = f"smp_compat: stopping rank {_watch.rank} because {message.splitlines()[0]}"
    write_error_file(line, line)
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


def write_error_file(message: str, details: str) -> None:
    """torch elastic's error file, when the launcher asked for one: ``message`` and a ``details`` traceback.

    torchrun prints ``details`` (``py_callstack``) under "Root Cause"; best effort, never raises.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": details, "timestamp": str(int(time.time()))}}}
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
