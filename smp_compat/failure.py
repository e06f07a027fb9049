"""Job-wide failure propagation: one rank's error stops every rank within seconds, never a hang.

A failing rank writes its error into the process group's key-value store; every rank runs a small
watch thread that polls the store and, when another rank has failed, prints one line naming that
rank and its error and ends the process. Collective timeouts alone would take many minutes.

The line leads with the root exception (for a ``RemoteError``: the original exception, its rank and
module), and every rank that ends this way writes torch elastic's error file, so that torchrun's
closing summary names the cause too (``root_cause``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

from smp_compat import root_cause
from smp_compat._compat import default_store

__all__ = [
    "start_watch", "stop_watch", "publish", "publish_exception", "peer_failure", "stop_because", "POLL_SECONDS",
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
    publish(root_cause.summary(exc))


def _excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """An uncaught error: tell the others, print it, and exit now, so launchers report this rank first."""
    publish_exception(exc)
    root = root_cause.root_of(exc, _watch.rank)
    details = "".join(traceback.format_exception(kind, exc, tb)).rstrip()
    root_cause.write_error_file(root.line(), f"{details}\n\nsmp_compat: rank {_watch.rank} failed: {root.line()}")
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
    root_cause.write_error_file(line, line)
    return line


def stop_because(message: str) -> None:
    """End this rank with one line naming the rank that failed and the root exception (exit code 17)."""
    sys.stderr.write(_record_stop(message) + "\n")
    sys.stderr.flush()
    os._exit(_EXIT_CODE)
