"""Ordered message channels between the ranks of a pipeline group.

One channel per (sender, receiver) direction: sends and receives match by order on their own channel,
never by timing or tags (NCCL has none). Ranks on one host use a shared-memory link
(``local_links.py``), read by the receiving rank's scheduler itself; other pairs use a two-member process
group, where sends start asynchronously from the calling thread, which waits only for sends older than
the last two (done in practice) to reuse their buffers, and one receiver thread per peer delivers what
arrives. The thread is needed there: a gloo receive cannot be polled (``is_completed()`` stays False until
``wait()``, ``get_future()`` is missing for p2p, and a ``wait`` with a timeout closes the connection when
it expires).

Each message is one packed buffer (``messages.py``). Gloo accepts a receive buffer larger than the
message, so its receiver always has a buffer of the agreed capacity posted, and the sender first
announces a larger capacity when a message needs it; NCCL needs exact sizes: a fixed-size head goes
first, then the rest. Gloo moves only host memory, so on a GPU shared over gloo messages are packed on the
host and their tensors are moved to the compute device on arrival.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from smp_compat import timeline
from smp_compat.runtime.local_links import LocalLink, link_local_pairs
from smp_compat.runtime.mailbox import Mailbox
from smp_compat.runtime.messages import HEADER_BYTES, Message, lengths, nbytes, pack, unpack
from smp_compat.runtime.thread_state import cuda_device_setter

__all__ = ["Transport", "create_channel_groups"]

log = logging.getLogger("smp_compat")

_INITIAL_CAPACITY = 1 << 16


def create_channel_groups(pp_groups: list[list[int]]) -> dict[tuple[int, int], Any]:
    """One channel per ordered pair inside each pipeline group; every rank creates all, in one order.

    A process group each, and a shared-memory link instead for this rank's pairs on one host.
    """
    groups = {}
    for members in pp_groups:
        for src in members:
            for dst in members:
                if src != dst:
                    groups[(src, dst)] = dist.new_group([src, dst])
    return link_local_pairs(groups)


def _wire_device(groups: dict[tuple[int, int], Any], rank: int, peers: list[int], device: torch.device) -> torch.device:
    """Where message buffers live: the compute device with NCCL, host memory with gloo (it moves only host bytes)."""
    if device.type == "cpu" or not peers:
        return device
    channel = groups[(rank, peers[0])]
    group = channel.group if isinstance(channel, LocalLink) else channel
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


class Transport:
    """Send and receive ``Message``s with the other ranks of this rank's pipeline group.

    Sends go out from the calling thread: into a peer's shared-memory ring, or as asynchronous p2p
    operations (their buffers are kept until done and then reused). What arrives reaches ``inbox``: read
    from the links by the scheduler itself, delivered by a receiver thread per process-group channel. On
    a machine whose cores are busy computing, every thread that must wake up on a message's way adds
    latency, so a send wakes none of ours.
    """

    def __init__(
        self,
        rank: int,
        peers: list[int],
        groups: dict[tuple[int, int], Any],
        device: torch.device,
        inbox: Mailbox,
    ) -> None:
        self.rank = rank
        self.peers = peers
        self.compute_device = device
        self.device = _wire_device(groups, rank, peers, device)
        self.deliver = inbox.put
        self.exact_sizes = self.device.type != "cpu"  # NCCL: receive sizes must match the send
        self.payload_bytes = 0
        self.messages = 0
        self._outgoing = {p: _Outgoing(_channel(groups[(rank, p)], p)) for p in peers}
        self._threads: list[threading.Thread] = []
        self._set_device = cuda_device_setter(device)
        self._incoming = [_channel(groups[(peer, rank)], peer) for peer in peers]
        self._sources: list[_LinkSource] = []
        for peer, channel in zip(peers, self._incoming):
            if isinstance(channel, LocalLink):  # read by the scheduler itself: no thread to wake
                self._sources.append(_LinkSource(self, peer, channel))
                inbox.add_source(self._sources[-1])
                continue
            thread = threading.Thread(target=self._recv_loop, args=(peer, channel), name=f"smp-recv-{peer}->{rank}",
                                      daemon=True)  # fmt: skip
            thread.start()
            self._threads.append(thread)
        for out in self._outgoing.values():
            if isinstance(out.channel, LocalLink):
                out.channel.on_stall = self._take_in_links

    def links(self) -> dict[int, str]:
        """How each peer's messages travel: "shared memory", or the backend of its process group (for reports:
        ``smp-compat selftest``)."""
        return {peer: "shared memory" if isinstance(out.channel, LocalLink) else dist.get_backend(out.channel.group)
                for peer, out in self._outgoing.items()}  # fmt: skip

    def send(self, dst: int, kind: str, meta: dict[str, Any] | None = None, tensors: list[torch.Tensor] = ()) -> None:
        """Pack and start sending a message to ``dst``; returns without waiting for the transfer."""
        start = timeline.now()
        tensors = [t.detach() for t in tensors]
        self.payload_bytes += sum(nbytes(t) for t in tensors)
        self.messages += 1
        try:
            self._start_send(self._outgoing[dst], kind, meta or {}, tensors)
        except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it with the likely cause
            # a peer that left closed its link after sending "close": that goes to the engine first, so it
            # names the departure rather than this rank's failed send (a link's send fails at once)
            self._take_in_links()
            self.deliver(Message("transport_error", dst, {"error": f"sending to rank {dst}: {exc}"}))
        _record(f"send->{dst}", kind, start)

    def _start_send(self, out: _Outgoing, kind: str, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        if isinstance(out.channel, LocalLink):
            with out.lock:  # packed straight into the ring when it fits in one chunk
                buf = pack(kind, meta, tensors, self.device, into=out.channel.reserve)
                out.channel.send_async(buf)
            return
        with out.lock:
            reuse = out.free_buffer()
            buf = pack(kind, meta, tensors, self.device, into=_prefix_of(reuse))
            whole = reuse if reuse is not None and buf.data_ptr() == reuse.data_ptr() else buf
            if self.exact_sizes:
                out.start(buf[:HEADER_BYTES], whole)
                if buf.numel() > HEADER_BYTES:
                    out.start(buf[HEADER_BYTES:], whole)
            else:
                if buf.numel() > out.peer_capacity:
                    out.peer_capacity = max(buf.numel(), 2 * out.peer_capacity)
                    announce = pack("capacity", {"bytes": out.peer_capacity}, [], self.device)
                    out.start(announce, announce)
                out.start(buf, whole)

    def close(self) -> None:
        """Tell every peer we are done and wait for our sends and receiver threads (every pipeline rank calls this)."""
        for peer in self.peers:
            self.send(peer, "close")
        for out in self._outgoing.values():
            try:
                out.finish()
            except Exception:  # noqa: BLE001 - at shutdown a peer may be gone already; nothing waits for this
                log.debug("pipeline send still in progress failed at shutdown", exc_info=True)
        for thread in self._threads:
            thread.join(timeout=10)
        for channel in [*(out.channel for out in self._outgoing.values()), *self._incoming]:
            if isinstance(channel, LocalLink):
                channel.close()

    def _recv_loop(self, src: int, channel: _Channel) -> None:
        self._set_device()
        capacity = _INITIAL_CAPACITY
        receive_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        while True:
            try:
                if receive_buffer.numel() < capacity:
                    receive_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
                buf = self._recv_one(channel, receive_buffer)
                start = timeline.now()
                message = self._unpack(buf, src, copy=buf is receive_buffer)
            except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
                self.deliver(_receive_error(src, exc))
                return
            if message.kind == "capacity":
                capacity = message.meta["bytes"]
                continue
            self.deliver(_for_engine(message, start))
            if message.kind == "close":
                return

    def _unpack(self, buf: torch.Tensor, src: int, copy: bool) -> Message:
        message = unpack(buf, src, copy=copy)
        if self.compute_device != self.device:
            message.tensors = [t.to(self.compute_device) for t in message.tensors]
        return message

    def _take_in_links(self) -> None:
        """Take in what our links hold now: while a send waits for ring space (their senders may be waiting
        on us), and before reporting a failed send."""
        for source in self._sources:
            for message in source.poll():
                self.deliver(message)

    def _recv_one(self, channel: _Channel, receive_buffer: torch.Tensor) -> torch.Tensor:
        """gloo: into the reused capacity buffer; NCCL: into fresh exact-size buffers (their tensors are views)."""
        if not self.exact_sizes:
            channel.recv(receive_buffer)
            return receive_buffer
        head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        channel.recv(head)
        total, _ = lengths(head)
        if total <= HEADER_BYTES:
            return head
        rest = torch.empty(total - HEADER_BYTES, dtype=torch.uint8, device=self.device)
        channel.recv(rest)
        return torch.cat([head, rest])


class _LinkSource:
    """A shared-memory link from one peer, read by the scheduler's baton holder (``mailbox.Source``)."""

    def __init__(self, transport: Transport, src: int, link: LocalLink) -> None:
        self.transport = transport
        self.src = src
        self.link = link
        self.closed = False
        self._lock = threading.Lock()  # a stalled send may read it from another thread

    def fileno(self) -> int:
        return self.link.sock.fileno()

    def poll(self, readable: bool = False) -> list[Message]:
        arrived: list[Message] = []
        if self.closed or not self._lock.acquire(blocking=False):  # held: someone is reading it right now
            return arrived
        try:
            while not self.closed:
                try:
                    buf = self.link.receive_now(readable)
                    readable = False
                    if buf is None:
                        break
                    start = timeline.now()
                    message = self.transport._unpack(buf, self.src, copy=True)
                    self.link.release()
                except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
                    self.closed = True
                    arrived.append(_receive_error(self.src, exc))
                    break
                arrived.append(_for_engine(message, start))
                self.closed = message.kind == "close"
        finally:
            self._lock.release()
        return arrived


def _for_engine(message: Message, received_at: float) -> Message:
    """What the engine gets for an arrived message: itself, or ``peer_closed`` for the peer's ``close``."""
    _record(f"recv<-{message.src}", message.kind, received_at)
    # the peer shut down; the engine decides whether that was too early
    return Message("peer_closed", message.src) if message.kind == "close" else message


def _receive_error(src: int, exc: BaseException) -> Message:
    return Message("transport_error", src, {"error": f"receiving from rank {src}: {exc}"})


def _prefix_of(buffer: torch.Tensor | None) -> Callable[[int], torch.Tensor | None]:
    """``pack``'s ``into`` for a reusable buffer: its first ``n`` bytes when the message fits."""
    return lambda n: buffer[:n] if buffer is not None and buffer.numel() >= n else None


class _Outgoing:
    """The sends to one peer still in progress, with their buffers, and the buffers free for reuse."""

    _KEEP_FREE = 4
    _WINDOW = 2  # sends kept in flight without waiting for them

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()  # sends on one channel start in message order
        self.peer_capacity = _INITIAL_CAPACITY
        self._in_flight: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._free: list[torch.Tensor] = []

    def start(self, part: torch.Tensor, owner: torch.Tensor) -> None:
        """Start sending ``part`` of ``owner`` (a whole buffer), which is kept until the send is done."""
        self._in_flight.append((self.channel.send_async(part), owner))

    def free_buffer(self) -> torch.Tensor | None:
        """The largest buffer whose sends are done (raises a send's error), or None.

        Gloo marks a send complete only inside ``wait()`` (``is_completed()`` stays False until then), so
        sends older than the last ``_WINDOW`` are waited for: they are done in practice (the peer always has
        a receive posted). Without that, gloo kept every message buffer for the engine's lifetime.
        """
        while self._in_flight and (len(self._in_flight) > self._WINDOW or self._in_flight[0][0].is_completed()):
            work, owner = self._in_flight.popleft()
            work.wait()  # raises if the send failed
            if not any(owner is o for _, o in self._in_flight):
                self._free.append(owner)
        if not self._free:
            return None
        self._free.sort(key=lambda b: b.numel())
        del self._free[: -self._KEEP_FREE]
        return self._free.pop()

    def finish(self) -> None:
        while self._in_flight:
            work, _ = self._in_flight.popleft()
            work.wait()


def _channel(group_or_link: Any, peer: int) -> _Channel | LocalLink:
    return group_or_link if isinstance(group_or_link, LocalLink) else _Channel(group_or_link, peer)


class _Channel:
    """One direction between two ranks: its two-member process group, called directly.

    ``dist.isend``/``dist.recv`` re-resolve the group and the peer's group rank on every call (their
    Python wrappers cost more than a small gloo transfer).
    """

    def __init__(self, group: Any, peer: int) -> None:
        self.group = group
        self.peer = dist.get_group_rank(group, peer)

    def send_async(self, buf: torch.Tensor) -> Any:
        return self.group.send([buf], self.peer, 0)

    def recv(self, buf: torch.Tensor) -> None:
        self.group.recv([buf], self.peer, 0).wait()


def _record(track: str, kind: str, start: float) -> None:
    recorder = timeline.current()
    if recorder is not None:
        recorder.add(timeline.Span(track, kind, "comm", start, timeline.now()))
