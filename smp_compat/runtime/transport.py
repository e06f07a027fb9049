"""Ordered message channels between the ranks of a pipeline group, over torch.distributed p2p.

One process group per (sender, receiver) direction, one sender and one receiver thread per peer:
sends and receives match by order on their own channel, never by timing or tags (NCCL has none),
and the compute thread never blocks on a send.

A message (pickled kind, metadata and tensor specs, then the tensors' bytes) is packed into ONE
buffer. On gloo each extra send cost ~2 ms here (a message that arrives before its receive is
posted takes a slow path), while one send of any size took ~0.5 ms; gloo accepts a receive
buffer larger than the message, so the receiver always has a buffer of the agreed capacity
posted, and the sender first announces a larger capacity when a message needs it. NCCL needs
exact sizes: there a fixed-size head goes first, then the rest of the packed buffer.
"""

from __future__ import annotations

import ctypes
import pickle
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from smp_compat import timeline
from smp_compat.serialize import tensor_to_object

__all__ = ["Message", "Transport", "create_channel_groups", "pack", "unpack", "HEADER_BYTES"]

HEADER_BYTES = 4096
_INITIAL_CAPACITY = 1 << 16
_ALIGN = 64
_LENGTHS = struct.Struct("<qq")


@dataclass
class Message:
    """One unit of pipeline traffic."""

    kind: str
    src: int
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)


def create_channel_groups(pp_groups: list[list[int]]) -> dict[tuple[int, int], Any]:
    """One process group per ordered pair inside each pipeline group; every rank creates all, in one order."""
    groups = {}
    for members in pp_groups:
        for src in members:
            for dst in members:
                if src != dst:
                    groups[(src, dst)] = dist.new_group([src, dst])
    return groups


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(
    kind: str, meta: dict[str, Any], tensors: list[torch.Tensor], device: torch.device, into: torch.Tensor | None = None
) -> torch.Tensor:
    """One uint8 buffer: total and header lengths, the pickled header, then each tensor's bytes, aligned.

    Written into ``into`` (a reusable buffer, grown when too small) when given; returns the used prefix.
    """
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += _aligned(t.numel() * t.element_size())
    specs = [(tuple(t.shape), t.dtype, o) for t, o in zip(tensors, offsets)]
    header = _LENGTHS.pack(0, 0) + pickle.dumps((kind, meta, specs), protocol=pickle.HIGHEST_PROTOCOL)
    header_len = len(header) - _LENGTHS.size
    start = _aligned(len(header))
    total = max(start + offset, HEADER_BYTES)
    header = _LENGTHS.pack(total, header_len) + header[_LENGTHS.size :]
    buf = into[:total] if into is not None and into.numel() >= total else torch.empty(total, dtype=torch.uint8, device=device)
    buf[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    for t, o in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            buf[start + o : start + o + n].view(t.dtype).view(t.shape).copy_(t)
    return buf


def _lengths(buf: torch.Tensor) -> tuple[int, int]:
    head = buf[: _LENGTHS.size]
    if head.device.type != "cpu":
        head = head.cpu()
    return _LENGTHS.unpack(ctypes.string_at(head.data_ptr(), _LENGTHS.size))


def unpack(buf: torch.Tensor, src: int, copy: bool = True) -> Message:
    """Inverse of ``pack``. ``copy``: the tensors own their memory (``buf`` is a reused receive buffer)."""
    total, header_len = _lengths(buf)
    kind, meta, specs = tensor_to_object(buf[_LENGTHS.size : _LENGTHS.size + header_len], header_len)
    start = _aligned(_LENGTHS.size + header_len)
    tensors = []
    for shape, dtype, o in specs:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        t = buf[start + o : start + o + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype, device=buf.device)
        tensors.append(t.clone() if copy and n else t)
    return Message(kind, src, meta, tensors)


class Transport:
    """Send and receive ``Message``s with the other ranks of this rank's pipeline group."""

    def __init__(
        self,
        rank: int,
        peers: list[int],
        groups: dict[tuple[int, int], Any],
        device: torch.device,
        deliver: Callable[[Message], None],
    ) -> None:
        self.rank = rank
        self.peers = peers
        self.groups = groups
        self.device = device
        self.deliver = deliver
        self.exact_sizes = device.type != "cpu"  # NCCL: receive sizes must match the send
        self.payload_bytes = 0
        self.messages = 0
        self._peer_capacity = {p: _INITIAL_CAPACITY for p in peers}
        self._outboxes: dict[int, queue.SimpleQueue] = {p: queue.SimpleQueue() for p in peers}
        self._threads: list[threading.Thread] = []
        for peer in peers:
            self._start(self._send_loop, peer, f"smp-send-{rank}->{peer}")
            self._start(self._recv_loop, peer, f"smp-recv-{peer}->{rank}")

    def _start(self, target: Callable[[int], None], peer: int, name: str) -> None:
        thread = threading.Thread(target=target, args=(peer,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def send(self, dst: int, kind: str, meta: dict[str, Any] | None = None, tensors: list[torch.Tensor] = ()) -> None:
        """Queue a message for ``dst``; returns at once."""
        tensors = [t.detach() for t in tensors]
        self.payload_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.messages += 1
        self._outboxes[dst].put((kind, meta or {}, tensors))

    def close(self) -> None:
        """Tell every peer we are done and wait for our threads (every pipeline rank calls this)."""
        for peer in self.peers:
            self._outboxes[peer].put(("close", {}, []))
        for thread in self._threads:
            thread.join(timeout=10)

    # ------------------------------------------------------------------ threads
    def _send_loop(self, dst: int) -> None:
        group = self.groups[(self.rank, dst)]
        send_buffer = torch.empty(_INITIAL_CAPACITY, dtype=torch.uint8, device=self.device)
        while True:
            kind, meta, tensors = self._outboxes[dst].get()
            start = timeline.now()
            try:
                buf = pack(kind, meta, tensors, self.device, into=send_buffer)
                if buf.untyped_storage().data_ptr() != send_buffer.untyped_storage().data_ptr():
                    send_buffer = buf  # grown: keep the larger one (dist.send returns once the data is out)
                self._send_one(dst, group, buf)
                _record(f"send->{dst}", kind, start)
            except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
                self.deliver(Message("transport_error", dst, {"error": f"sending to rank {dst}: {exc}"}))
                return
            if kind == "close":
                return

    def _send_one(self, dst: int, group: Any, buf: torch.Tensor) -> None:
        if self.exact_sizes:
            dist.send(buf[:HEADER_BYTES], dst, group=group)
            if buf.numel() > HEADER_BYTES:
                dist.send(buf[HEADER_BYTES:], dst, group=group)
            return
        if buf.numel() > self._peer_capacity[dst]:
            grown = max(buf.numel(), 2 * self._peer_capacity[dst])
            dist.send(pack("capacity", {"bytes": grown}, [], self.device), dst, group=group)
            self._peer_capacity[dst] = grown
        dist.send(buf, dst, group=group)

    def _recv_loop(self, src: int) -> None:
        group = self.groups[(src, self.rank)]
        capacity = _INITIAL_CAPACITY
        receive_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        while True:
            try:
                if receive_buffer.numel() < capacity:
                    receive_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
                buf = self._recv_one(src, group, receive_buffer)
                start = timeline.now()
                message = unpack(buf, src, copy=buf is receive_buffer)
            except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
                self.deliver(Message("transport_error", src, {"error": f"receiving from rank {src}: {exc}"}))
                return
            if message.kind == "capacity":
                capacity = message.meta["bytes"]
                continue
            _record(f"recv<-{src}", message.kind, start)
            if message.kind == "close":
                return
            self.deliver(message)

    def _recv_one(self, src: int, group: Any, receive_buffer: torch.Tensor) -> torch.Tensor:
        """gloo: into the reused capacity buffer; NCCL: into fresh exact-size buffers (their tensors are views)."""
        if not self.exact_sizes:
            dist.recv(receive_buffer, src, group=group)
            return receive_buffer
        head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        dist.recv(head, src, group=group)
        total, _ = _lengths(head)
        if total <= HEADER_BYTES:
            return head
        rest = torch.empty(total - HEADER_BYTES, dtype=torch.uint8, device=self.device)
        dist.recv(rest, src, group=group)
        return torch.cat([head, rest])


def _record(track: str, kind: str, start: float) -> None:
    recorder = timeline.current()
    if recorder is not None:
        recorder.add(timeline.Span(track, kind, "comm", start, timeline.now()))
