"""Python objects to byte tensors and back, without numpy (torch's object collectives need it)."""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["object_to_tensor", "tensor_to_object", "all_gather_objects", "broadcast_object"]


def object_to_tensor(obj: Any, device: torch.device | None = None) -> torch.Tensor:
    """Pickle ``obj`` into a 1-D uint8 tensor on ``device``."""
    tensor = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    return tensor if device is None or device.type == "cpu" else tensor.to(device)


def tensor_to_object(tensor: torch.Tensor, length: int | None = None) -> Any:
    """Inverse of ``object_to_tensor``; ``length`` trims padding."""
    data = tensor.detach().to("cpu").contiguous()
    n = data.numel() if length is None else length
    return pickle.loads(ctypes.string_at(data.data_ptr(), n))


def all_gather_objects(obj: Any, group: Any, group_size: int, device: torch.device) -> list[Any]:
    """Every member's ``obj`` in torch's (sorted global rank) order of ``group``."""
    payload = object_to_tensor(obj, device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(group_size)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    sizes = [int(t.item()) for t in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    chunks = [torch.empty_like(padded) for _ in range(group_size)]
    dist.all_gather(chunks, padded, group=group)
    return [tensor_to_object(c, n) for c, n in zip(chunks, sizes)]


def broadcast_object(obj: Any, src: int, group: Any = None, device: torch.device | None = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (the world by default)."""
    device = device or _default_device()
    is_src = dist.get_rank() == src
    payload = object_to_tensor(obj, device) if is_src else None
    length = torch.tensor([payload.numel() if is_src else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    if not is_src:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return obj if is_src else tensor_to_object(payload)


def _default_device() -> torch.device:
    backend = dist.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
