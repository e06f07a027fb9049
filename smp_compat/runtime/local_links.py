"""Pipeline channels between processes on one host: a shared-memory ring per direction, not gloo's sockets.

Why: on a CPU host every rank computes on its own core, and each gloo message wakes gloo's loop threads
on both sides (a 64-256 KiB message reaches its TCP socket in several pieces) and a receiver thread of
ours: those wake-ups preempt the computing thread. Here the sender copies the packed message into a
ring of memory both processes map (a ``memfd`` passed over a Unix socket, so nothing is left behind if a
process dies) and writes one 24-byte note on that socket; the receiving rank's scheduler reads the note
and the bytes itself at its next task hand-over (``mailbox.py``), so no other thread wakes, and a dead
peer shows at once as end-of-file on the socket.

Only on Linux x86-64 (abstract Unix sockets and ``memfd``; the ring's read position is published with a
plain store, which x86's memory ordering keeps after the loads that read the message). Elsewhere, with
``SMP_COMPAT_SHARED_MEMORY=0``, between hosts, and for NCCL channels, the process-group channel stays.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import secrets
import select
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LocalLink", "link_local_pairs", "ENV"]

log = logging.getLogger("smp_compat")

ENV = "SMP_COMPAT_SHARED_MEMORY"
RING_BYTES = 32 << 20
"""Each direction's ring; a larger message goes through in chunks of half of it."""
_CONTROL_BYTES = 4096  # the receiver's read position and the sender's "waiting for space" flag
_NOTE = struct.Struct("<qqq")  # absolute start of a chunk, its length, bytes of the message still to come
_SPACE_POLL_S = 0.002  # a sender waiting for space also rechecks this often (the flag hand-shake may race)
_ACCEPT_TIMEOUT_S = 60.0
_PEER_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
Pair = tuple[int, int]  # (sending rank, receiving rank)


class _Sent:
    """What ``send_async`` returns: the bytes are in the ring when it returns, so the send is complete."""

    @staticmethod
    def is_completed() -> bool:
        return True

    @staticmethod
    def wait() -> None:
        return None


class LocalLink:
    """One direction between two processes of one host: the ring both map and the socket notes travel on.

    The sender end is used under the transport's per-channel lock, the receiver end by one reader at a time
    (the transport's ``_LinkSource``). Positions are absolute byte counts; the ring index is ``% RING_BYTES``.
    """

    def __init__(self, group: Any, peer: int, sock: socket.socket, fd: int) -> None:
        self.group = group  # the process-group channel it replaces (its backend decides the wire device)
        self.peer = peer
        self.sock = sock
        self.ring = mmap.mmap(fd, _CONTROL_BYTES + RING_BYTES)
        os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.ring)) + _CONTROL_BYTES
        self.read_pos = ctypes.c_int64.from_buffer(self.ring, 0)
        self.sender_waiting = ctypes.c_int64.from_buffer(self.ring, 64)
        self.notes_sent = ctypes.c_int64.from_buffer(self.ring, 128)  # counted before each note is written
        self._notes_read = 0
        self._ring_bytes = torch.frombuffer(self.ring, dtype=torch.uint8, offset=_CONTROL_BYTES, count=RING_BYTES)
        self.write_pos = 0
        self._reserved: tuple[int, int] | None = None  # ring space handed out by ``reserve``, not yet sent
        self._free_to = 0  # every byte before it is read or skipped (a warm start skips the ring's rest)
        self.on_stall: Callable[[], None] = lambda: None  # called while a send waits for ring space
        self._note = bytearray(_NOTE.size)
        self._note_got = 0
        self._release_to = 0
        self._gathering: torch.Tensor | None = None  # a message larger than one chunk, while it arrives
        self._gathered = 0

    # -- sender end --------------------------------------------------------------------------------

    def reserve(self, size: int) -> torch.Tensor | None:
        """Ring space to pack a message of ``size`` bytes into (``send_async`` it next), or None if it is
        larger than one chunk."""
        if size > RING_BYTES // 2:
            return None
        start = self._reserve(size)
        self._reserved = (start, size)
        return self._ring_bytes[start % RING_BYTES : start % RING_BYTES + size]

    def send_async(self, buf: torch.Tensor) -> _Sent:
        """Send ``buf``: space from ``reserve`` (just the note), or contiguous host bytes, copied into the
        ring chunk by chunk with a note per chunk."""
        if self._reserved is not None:
            (start, size), self._reserved = self._reserved, None
            if buf.data_ptr() == self.base + start % RING_BYTES:
                self.notes_sent.value += 1
                self.sock.sendall(_NOTE.pack(start, size, 0))
                return _Sent()
        total, address, sent = buf.numel(), buf.data_ptr(), 0
        while True:
            size = min(total - sent, RING_BYTES // 2)
            start = self._reserve(size)
            ctypes.memmove(self.base + start % RING_BYTES, address + sent, size)
            sent += size
            self.notes_sent.value += 1
            self.sock.sendall(_NOTE.pack(start, size, total - sent))
            if sent == total:
                return _Sent()

    def _reserve(self, size: int) -> int:
        """The ring position of the next ``size`` contiguous bytes, once the receiver has freed them."""
        start = self.write_pos
        wraps = start % RING_BYTES + size > RING_BYTES  # never wrap inside a chunk: skip the ring's tail
        all_read = self.read_pos.value == start and start % RING_BYTES >= size  # then the ring's warm start
        if wraps or all_read:  # (both only skip bytes the receiver has passed or will pass: size <= ring / 2)
            start += RING_BYTES - start % RING_BYTES
        if all_read:  # nothing before ``start`` is unread, though read_pos stays behind until this chunk is read
            self._free_to = start
        while start + size - max(self.read_pos.value, self._free_to) > RING_BYTES:
            self._wait_for_space(start + size - RING_BYTES)
        self.write_pos = start + size
        return start

    def _wait_for_space(self, needed_read_pos: int) -> None:
        self.sender_waiting.value = 1
        if self.read_pos.value >= needed_read_pos:
            self.sender_waiting.value = 0
            return
        self.on_stall()  # the receiver may be waiting to send to us: read what it sent, or both would wait
        readable, _, _ = select.select([self.sock], [], [], _SPACE_POLL_S)
        if readable and not self.sock.recv(4096):
            raise ConnectionError(f"connection closed by rank {self.peer} (shared-memory channel)")

    # -- receiver end ------------------------------------------------------------------------------

    def receive_now(self, readable: bool = False) -> torch.Tensor | None:
        """The next message's bytes once all of it has arrived, else None; never waits.

        A message in one chunk is returned as a view of the ring, valid until ``release``. A larger one is
        gathered into a fresh buffer chunk by chunk across calls (waiting for the rest here could wedge two
        ranks that send each other large messages: each would wait inside its own stalled send).
        ``readable``: ``select`` said the socket is readable (a note, or end-of-file if the peer is gone).
        """
        while (note := self._note_now(readable)) is not None:
            readable = False
            start, size, more = note
            if self._gathering is None and not more:
                self._release_to = start + size
                return self._ring_bytes[start % RING_BYTES : start % RING_BYTES + size]
            if self._gathering is None:
                self._gathering, self._gathered = torch.empty(size + more, dtype=torch.uint8), 0
            ctypes.memmove(self._gathering.data_ptr() + self._gathered, self.base + start % RING_BYTES, size)
            self._gathered += size
            self._release_to = start + size
            self.release()
            if not more:
                whole, self._gathering = self._gathering, None
                return whole
        return None

    def release(self) -> None:
        """Give the ring space of the last message read back to the sender (and wake it if it waits for it)."""
        self.read_pos.value = self._release_to
        if self.sender_waiting.value:
            self.sender_waiting.value = 0
            self.sock.sendall(b"\x01")

    def _note_now(self, readable: bool) -> tuple[int, int, int] | None:
        """The next whole note, or None if it has not (all) arrived."""
        if self.notes_sent.value == self._notes_read and not self._note_got and not readable:
            return None  # nothing sent since the last note read: no system call (most polls)
        try:
            got = self.sock.recv_into(memoryview(self._note)[self._note_got :], flags=socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if not got:
            raise ConnectionError(f"connection closed by rank {self.peer} (shared-memory channel)")
        self._note_got += got
        if self._note_got < _NOTE.size:
            return None
        self._note_got = 0
        self._notes_read += 1
        return _NOTE.unpack(self._note)

    def close(self) -> None:
        self.sock.close()


def enabled() -> bool:
    """Whether this process may use shared-memory channels (Linux x86-64, not turned off)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and hasattr(os, "memfd_create")


def link_local_pairs(groups: dict[Pair, Any]) -> dict[Pair, Any]:
    """``groups`` with a ``LocalLink`` in place of each of this rank's channels whose peer shares its host.

    Collective over the world (every rank calls it with the same pairs, as when the groups were made). A
    pair whose link fails to open on either end keeps its process group, on both ends.
    """
    if not groups or not _host_bytes_only():
        return groups
    rank = dist.get_rank()
    hosts = [None] * dist.get_world_size()
    identity = _host_identity() if enabled() else None
    dist.all_gather_object(hosts, (identity, secrets.token_hex(8), os.getpid()) if identity else None)
    if hosts[0] is None:
        return groups
    token = hosts[0][1]
    local = [(s, d) for s, d in groups if hosts[s] is not None and hosts[d] is not None and hosts[s][0] == hosts[d][0]]
    listeners = {(s, d): _listen(token, s, d) for s, d in local if d == rank}
    dist.barrier()  # every listener is bound before any sender connects
    outgoing = {(s, d): _connect(token, s, d) for s, d in local if s == rank}
    ok = _agree(local, [p for p, v in [*listeners.items(), *outgoing.items()] if v is None])
    incoming = {(s, d): _accept(listeners[(s, d)], hosts[s][2]) for s, d in listeners if (s, d) in ok}
    for listener in listeners.values():
        if listener is not None:
            listener.close()
    ok = _agree(ok, [p for p, v in incoming.items() if v is None])
    linked = dict(groups)
    for (s, d), ends in [*outgoing.items(), *incoming.items()]:
        peer = d if s == rank else s
        if (s, d) in ok and ends is not None:
            linked[(s, d)] = LocalLink(groups[(s, d)], peer, *ends)
        elif ends is not None:
            ends[0].close()
            os.close(ends[1])
    return linked


def _host_bytes_only() -> bool:
    """Links carry host memory: only where the channels are gloo (an NCCL channel moves device memory)."""
    return dist.get_backend() == "gloo"


def _host_identity() -> tuple[str, str, int] | None:
    """Equal for two processes exactly when they share a kernel and a network namespace (abstract sockets);
    None where ``/proc`` cannot tell."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return socket.gethostname(), boot, os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None


def _address(token: str, src: int, dst: int) -> str:
    return f"\0smp-compat-{token}-{src}-{dst}"


def _listen(token: str, src: int, dst: int) -> socket.socket | None:
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(_address(token, src, dst))
        listener.listen(1)
        return listener
    except OSError:
        log.debug("shared-memory channel %d->%d: listen failed", src, dst, exc_info=True)
        return None


def _connect(token: str, src: int, dst: int) -> tuple[socket.socket, int] | None:
    """The sender end: make the ring, connect to the receiver, and pass the ring's descriptor with a first byte."""
    try:
        fd = os.memfd_create(f"smp-compat-{src}-{dst}", os.MFD_CLOEXEC)
        os.ftruncate(fd, _CONTROL_BYTES + RING_BYTES)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(_address(token, src, dst))
        socket.send_fds(sock, [b"r"], [fd])
        return sock, fd
    except OSError:
        log.debug("shared-memory channel %d->%d: connect failed", src, dst, exc_info=True)
        return None


def _accept(listener: socket.socket | None, sender_pid: int) -> tuple[socket.socket, int] | None:
    """The receiver end, from the sender's process only.

    Abstract socket names are listed in ``/proc/net/unix`` for every local user to see, and what arrives on
    a link is unpickled: a connection from any other process is refused (the pair then stays on gloo).
    """
    if listener is None:
        return None
    try:
        listener.settimeout(_ACCEPT_TIMEOUT_S)
        sock, _ = listener.accept()
        sock.settimeout(None)
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
        pid, _, _ = _PEER_CREDENTIALS.unpack(credentials)
        if pid != sender_pid:
            log.warning("shared-memory channel: refused a connection from process %d (expected %d)", pid, sender_pid)
            sock.close()
            return None
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        return (sock, fds[0]) if fds else None
    except OSError:
        log.debug("shared-memory channel: accept failed", exc_info=True)
        return None


def _agree(pairs: list[Pair] | set[Pair], failed_here: list[Pair]) -> set[Pair]:
    """The pairs no rank failed to set up (collective: every rank learns every rank's failures)."""
    failed: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failed, failed_here)
    return set(pairs) - {tuple(p) for f in failed for p in f}
