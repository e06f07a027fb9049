"""Pipeline messages: what one carries, and its packing into one buffer of bytes and back.

A message is packed into ONE buffer (total and header lengths, the pickled kind, metadata and tensor
specs, then each tensor's bytes, aligned): on gloo each extra send cost ~2 ms here, while one send of any
size took ~0.5 ms, and a shared-memory ring takes it with one copy. NCCL needs exact receive sizes, so its
messages are at least ``HEADER_BYTES`` long: a fixed-size head goes first, then the rest.
"""

from __future__ import annotations

import ctypes
import math
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from smp_compat.comm import tensor_to_object

__all__ = ["Message", "pack", "unpack", "HEADER_BYTES", "lengths", "nbytes"]

HEADER_BYTES = 4096
_ALIGN = 64
_LENGTHS = struct.Struct("<qq")


@dataclass
class Message:
    """One unit of pipeline traffic."""

    kind: str
    src: int
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(
    kind: str,
    meta: dict[str, Any],
    tensors: list[torch.Tensor],
    device: torch.device,
    into: Callable[[int], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """One uint8 buffer: total and header lengths, the pickled header, then each tensor's bytes, aligned.

    Written into ``into(total)`` when that gives a buffer (a reused one, or space in a shared-memory
    ring), else into a new one; returns it. On CPU the bytes move with ``memmove`` (no tensor operations:
    a message costs microseconds, not tens).
    """
    offsets, offset = [], 0
    for t in tensors:
        offsets.append(offset)
        offset += _aligned(nbytes(t))
    specs = [(tuple(t.shape), t.dtype, o) for t, o in zip(tensors, offsets)]
    header = pickle.dumps((kind, meta, specs), protocol=pickle.HIGHEST_PROTOCOL)
    start = _aligned(_LENGTHS.size + len(header))
    total = max(start + offset, HEADER_BYTES)
    head = _LENGTHS.pack(total, len(header)) + header
    buf = into(total) if into is not None else None
    if buf is None:
        buf = torch.empty(total, dtype=torch.uint8, device=device)
    if buf.device.type == "cpu":
        base = buf.data_ptr()
        ctypes.memmove(base, head, len(head))
        for t, o in zip(tensors, offsets):
            _copy_into(base + start + o, t)
        return buf
    buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    for t, o in zip(tensors, offsets):
        n = nbytes(t)
        if n:
            buf[start + o : start + o + n].view(t.dtype).view(t.shape).copy_(t)
    return buf


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.dtype.itemsize


def _copy_into(address: int, t: torch.Tensor) -> None:
    """CPU tensor bytes to ``address``: memmove, from a contiguous CPU copy when the tensor is not one."""
    n = nbytes(t)
    if not n:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        ctypes.memmove(address, t.data_ptr(), n)
        return
    staged = t.detach().to("cpu").contiguous()
    ctypes.memmove(address, staged.data_ptr(), n)


def lengths(buf: torch.Tensor) -> tuple[int, int]:
    head = buf[: _LENGTHS.size]
    if head.device.type != "cpu":
        head = head.cpu()
    return _LENGTHS.unpack(ctypes.string_at(head.data_ptr(), _LENGTHS.size))


def unpack(buf: torch.Tensor, src: int, copy: bool = True) -> Message:
    """Inverse of ``pack``. ``copy``: the tensors own their memory (``buf`` is a reused receive buffer)."""
    if buf.device.type != "cpu":
        return _unpack_device(buf, src, copy)
    base = buf.data_ptr()
    _, header_len = _LENGTHS.unpack(ctypes.string_at(base, _LENGTHS.size))
    kind, meta, specs = pickle.loads(ctypes.string_at(base + _LENGTHS.size, header_len))
    start = _aligned(_LENGTHS.size + header_len)
    tensors = []
    for shape, dtype, o in specs:
        n = math.prod(shape) * dtype.itemsize
        if copy or not n:
            t = torch.empty(shape, dtype=dtype, device="cpu")
            if n:
                ctypes.memmove(t.data_ptr(), base + start + o, n)
        else:
            t = buf[start + o : start + o + n].view(dtype).view(shape)
        tensors.append(t)
    return Message(kind, src, meta, tensors)


def _unpack_device(buf: torch.Tensor, src: int, copy: bool) -> Message:
    _, header_len = lengths(buf)
    kind, meta, specs = tensor_to_object(buf[_LENGTHS.size : _LENGTHS.size + header_len], header_len)
    start = _aligned(_LENGTHS.size + header_len)
    tensors = []
    for shape, dtype, o in specs:
        n = math.prod(shape) * dtype.itemsize
        t = buf[start + o : start + o + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype, device=buf.device)
        tensors.append(t.clone() if copy and n else t)
    return Message(kind, src, meta, tensors)
