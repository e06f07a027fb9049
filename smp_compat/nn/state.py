"""Whole tensors from tensor-parallel shards (full state dicts) and shards from whole tensors (loading)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from smp_compat.nn import comm
from smp_compat.nn.module import is_shard

__all__ = ["gather_shards", "slice_for_rank", "shard_layout", "shard_names"]


def shard_names(module: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict names of the shard parameters under ``module``."""
    return {name: p for name, p in module.named_parameters(remove_duplicate=False) if is_shard(p)}


def shard_layout(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Per shard entry: the dim it is cut along, its q|k|v-style blocks and its whole shape.

    Saved in every partial model part (``_smp_load_info["tp_shards"]``) so that an offline tool can
    merge or re-cut the parts at another tp degree without knowing the modules (tp_register'ed ones too).
    """
    out = {}
    for name, p in shard_names(module).items():
        out[name] = {"dim": p._smp_tp_dim, "blocks": p._smp_tp_blocks, "shape": _whole_shape(p)}
    return out


def _whole_shape(p: torch.Tensor) -> list[int]:
    """The shape the shards join to, as recorded when cut: a parameter of another pipeline stage is empty here."""
    recorded = getattr(p, "_smp_tp_shape", None)
    if recorded is not None:
        return list(recorded)
    shape = list(p.shape)  # a shard made without ``shard()``: only its local shape tells
    shape[p._smp_tp_dim] *= comm.tp_world()
    return shape


def _gather_one(local: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(comm.tp_world())]
    dist.all_gather(parts, local.detach().contiguous(), group=comm.tp_group())
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    sections = [torch.cat([p.chunk(blocks, dim=dim)[s] for p in parts], dim=dim) for s in range(blocks)]
    return torch.cat(sections, dim=dim)


def gather_shards(module: nn.Module, entries: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """``entries`` (``module.state_dict()``) with every shard replaced by the whole tensor; collective over tp."""
    out = OrderedDict(entries)
    if comm.tp_world() == 1:
        return out
    for name, p in shard_names(module).items():
        if name in out:
            out[name] = _gather_one(out[name], p._smp_tp_dim, p._smp_tp_blocks)
    if hasattr(entries, "_metadata"):
        out._metadata = entries._metadata  # type: ignore[attr-defined]
    return out


def slice_for_rank(module: nn.Module, entries: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A full state dict with every shard entry cut to this rank's slice (loading a full dict under tp)."""
    out = OrderedDict(entries)
    n, me = comm.tp_world(), comm.tp_index()
    for name, p in shard_names(module).items():
        value = out.get(name)
        if n == 1 or not isinstance(value, torch.Tensor) or value.shape == p.shape:
            continue
        dim, blocks = p._smp_tp_dim, p._smp_tp_blocks
        sections = value.chunk(blocks, dim=dim) if blocks > 1 else (value,)
        out[name] = torch.cat([s.chunk(n, dim=dim)[me] for s in sections], dim=dim)
    return out
