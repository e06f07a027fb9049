"""Ordered message channels between the ranks of a pipeline group, over torch.distributed p2p.

One process group per (sender, receiver) direction, one sender and one receiver thread per peer:
sends and receives match by order on their own channel, never by timing or tags (NCCL has none),
and the compute thread never blocks on a send. A message is a fixed-size header (pickled kind,
metadata and tensor specs) followed by its tensors.
"""

from __future__ import annotations

import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.serialize import object_to_tensor, tensor_to_object

__all__ = ["Message", "Transport", "create_channel_groups", "HEADER_BYTES"]

HEADER_BYTES = 4096
_LEN = struct.Struct("<q")


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
        self.payload_bytes = 0
        self.messages = 0
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
        tensors = [t.detach().contiguous() for t in tensors]
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
        while True:
            kind, meta, tensors = self._outboxes[dst].get()
            try:
                self._send_one(dst, group, kind, meta, tensors)
            except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
                self.deliver(Message("transport_error", dst, {"error": f"sending to rank {dst}: {exc}"}))
                return
            if kind == "close":
                return

    def _send_one(self, dst: int, group: Any, kind: str, meta: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        payload = object_to_tensor((kind, meta, specs))
        n = payload.numel()
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[: _LEN.size] = torch.frombuffer(bytearray(_LEN.pack(n)), dtype=torch.uint8)
        first = min(n, HEADER_BYTES - _LEN.size)
        header[_LEN.size : _LEN.size + first] = payload[:first]
        dist.send(header.to(self.device), dst, group=group)
        if n > first:
            dist.send(payload[first:].to(self.device), dst, group=group)
        for t in tensors:
            dist.send(t, dst, group=group)

    def _recv_loop(self, src: int) -> None:
        group = self.groups[(src, self.rank)]
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        while True:
            try:
                message = self._recv_one(src, group, header)
            except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
                self.deliver(Message("transport_error", src, {"error": f"receiving from rank {src}: {exc}"}))
                return
            if message.kind == "close":
                return
            self.deliver(message)

    def _recv_one(self, src: int, group: Any, header: torch.Tensor) -> Message:
        dist.recv(header, src, group=group)
        raw = header.cpu()
        (n,) = _LEN.unpack(bytes(raw[: _LEN.size].tolist()))
        first = min(n, HEADER_BYTES - _LEN.size)
        body = raw[_LEN.size : _LEN.size + first]
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8, device=self.device)
            dist.recv(rest, src, group=group)
            body = torch.cat([body, rest.cpu()])
        kind, meta, specs = tensor_to_object(body, n)
        tensors = []
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src, group=group)
            tensors.append(t)
        return Message(kind, src, meta, tensors)
