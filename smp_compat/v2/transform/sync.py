"""Make the ranks of one tp group start from one model: the group's first rank's.

``transform`` then splits each tensor-parallel weight from that rank (``parallelize_module`` scatters from
the group's rank 0), and this module broadcasts what stays whole (embeddings, norms, the head, buffers).
A group whose parameters are all on meta stays on meta and communicates nothing (delayed initialization
builds them later). A group whose first rank holds values while its peers are on meta is the
``load_state_dict_from_rank0`` case: the peers get empty tensors first, then the values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from smp_compat.errors import SMPConfigError

__all__ = ["agree_within_tp_group", "materialize_meta"]

_META, _REAL = 1, 2


def agree_within_tp_group(
    model: nn.Module,
    mesh: DeviceMesh,
    split: set[str],
    from_rank0: bool = False,
    device: torch.device | None = None,
) -> bool:
    """Give every rank of the tp group its first rank's values of the tensors not in ``split``.

    ``split``: names of the parameters ``parallelize_module`` will scatter. Returns False (and does nothing)
    when the whole group is on meta. ``from_rank0``: global rank 0 must hold values (its whole tp group raises
    otherwise). ``device``: where a peer's meta tensors are allocated (the CPU by default, as the scripts build
    models). Collective over the tp group.
    """
    group = mesh.get_group()
    comm = _comm_device(mesh)
    mine = _META if any(p.is_meta for p in model.parameters()) else _REAL
    kinds = [torch.empty(1, dtype=torch.int64, device=comm) for _ in range(mesh.size())]
    dist.all_gather(kinds, torch.tensor([mine], device=comm), group=group)
    kinds_list = [int(k.item()) for k in kinds]
    source = dist.get_global_rank(group, 0)
    if from_rank0 and source == 0 and kinds_list[0] == _META:
        raise SMPConfigError(
            "torch.sagemaker.transform(load_state_dict_from_rank0=True): rank 0 must hold the weights, but some of "
            "its parameters are on the meta device. Build rank 0's model with from_pretrained outside "
            "init_empty_weights (as AWS's scripts do)."
        )
    if all(k == _META for k in kinds_list):
        return False
    if kinds_list[0] == _META:
        raise SMPConfigError(
            f"torch.sagemaker.transform: tp rank 0 (global rank {source}) has parameters on the meta device "
            f"while a tp peer holds values (kinds per tp rank, 1 meta 2 values: {kinds_list}). The tp group's "
            "first rank must hold the weights (as rank 0 does under load_state_dict_from_rank0=True), or all "
            "of its ranks must be on meta."
        )
    materialize_meta(model, device or torch.device("cpu"))
    for _, tensor in _whole_tensors(model, split):
        _broadcast(tensor, source, group, comm)
    return True


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Replace meta parameters and buffers by uninitialized tensors on ``device``, keeping shared ones shared."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, value in table.items():
                if value is None or not value.is_meta:
                    continue
                if id(value) not in made:
                    empty = torch.empty_like(value, device=device)
                    if isinstance(value, nn.Parameter):
                        empty = nn.Parameter(empty, requires_grad=value.requires_grad)
                    made[id(value)] = empty
                table[key] = made[id(value)]


def _whole_tensors(model: nn.Module, split: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters outside ``split`` and every buffer, each shared tensor once, in a fixed order."""
    seen: set[int] = set()
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if name in split or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, tensor


def _broadcast(tensor: torch.Tensor, source: int, group: dist.ProcessGroup, comm: torch.device) -> None:
    with torch.no_grad():
        if tensor.device == comm:
            dist.broadcast(tensor.data, source, group=group)
            return
        staged = tensor.detach().to(comm)
        dist.broadcast(staged, source, group=group)
        tensor.data.copy_(staged)


def _comm_device(mesh: DeviceMesh) -> torch.device:
    """Where the group's backend takes tensors: the current GPU for a cuda mesh, else the CPU."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
