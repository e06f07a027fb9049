"""What a rank's scheduler waits on: messages other threads hand in, and channels it reads itself.

A shared-memory link (``local_links.py``) needs no receiver thread: the task that holds the baton reads
arrived messages at every hand-over and, when nothing is runnable, sleeps in one ``select`` on the links'
sockets. So a message never wakes a second thread, and one arriving while a task computes waits for the
next hand-over instead of preempting it. Process-group channels keep their receiver threads, which
``put`` here and wake the sleeper through a socket pair.
"""

from __future__ import annotations

import collections
import queue
import select
import socket
from typing import Any, Protocol

__all__ = ["Mailbox", "Source"]


class Source(Protocol):
    """A channel the baton holder reads itself."""

    closed: bool

    def fileno(self) -> int: ...

    def poll(self, readable: bool = False) -> list[Any]:
        """Every message that has arrived, in order, without waiting for more (``readable``: ``select`` said
        the channel's descriptor is readable, so look even if the source believes nothing was sent)."""


class Mailbox:
    """``queue.SimpleQueue``'s ``put``/``get``/``get_nowait`` over handed-in messages and polled sources."""

    def __init__(self) -> None:
        self._queue: collections.deque[Any] = collections.deque()
        self._sources: list[Source] = []
        self._wake_read, self._wake_write = socket.socketpair()  # closed with the mailbox, unlike a pipe's fds
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)

    def add_source(self, source: Source) -> None:
        self._sources.append(source)

    def put(self, message: Any) -> None:
        """Hand in a message (any thread); wakes a ``get`` that sleeps."""
        self._queue.append(message)
        try:
            self._wake_write.send(b"\0")
        except OSError:  # full of wake-ups nobody has read yet (so awake anyway), or closed at shutdown
            pass

    def get_nowait(self) -> Any:
        if not self._queue:
            for source in self._sources:
                if not source.closed:
                    self._queue.extend(source.poll())
        try:
            return self._queue.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout: float) -> Any:
        """The next message, waiting up to ``timeout`` seconds (``queue.Empty`` then)."""
        try:
            return self.get_nowait()
        except queue.Empty:
            pass
        sources = {s.fileno(): s for s in self._sources if not s.closed}
        readable, _, _ = select.select([self._wake_read, *sources], [], [], timeout)
        for fd in readable:
            if fd is self._wake_read:
                try:
                    self._wake_read.recv(4096)
                except BlockingIOError:
                    pass
            else:
                self._queue.extend(sources[fd].poll(readable=True))
        return self.get_nowait()

    def close(self) -> None:
        self._wake_read.close()
        self._wake_write.close()
