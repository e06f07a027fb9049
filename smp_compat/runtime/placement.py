"""Where each module runs under a partition plan, and what this rank keeps.

Modules that own parameters or buffers run on their planned rank. A module without state of its
own runs where all of its subtree's state lives when that is one rank (so a transformer block of
parameter-free container plus layers on rank 1 is one request, not one per layer); otherwise it
runs on its caller's rank, as SMP does for parameter-free modules.
"""

from __future__ import annotations

import torch
from torch import nn

from smp_compat.memory.model_creation import replace_in_place
from smp_compat.partitioning import PartitionPlan

__all__ = ["Placement"]


class Placement:
    """Per-module execution ranks of one model under one plan."""

    def __init__(self, root: nn.Module, plan: PartitionPlan) -> None:
        named = list(root.named_modules())
        self.names = [name for name, _ in named]
        self.modules = [module for _, module in named]
        self.plan = plan
        self._index = {id(m): i for i, m in enumerate(self.modules)}
        self._subtree_ranks = {id(m): self._ranks_below(n, m) for n, m in named}
        self._rank = {id(m): self._execution_rank(n, m) for n, m in named}

    def _ranks_below(self, name: str, module: nn.Module) -> frozenset[int]:
        """Ranks of the state modules in ``module``'s subtree (itself included)."""
        if not name:
            return frozenset(self.plan.assignment.values())
        prefix = f"{name}."
        return frozenset(r for n, r in self.plan.assignment.items() if n == name or n.startswith(prefix))

    def _execution_rank(self, name: str, module: nn.Module) -> int | None:
        own = self.plan.rank_of(name)
        if own is not None:
            return own
        ranks = self._subtree_ranks[id(module)]
        return next(iter(ranks)) if len(ranks) == 1 else None

    def rank_of_module(self, module: nn.Module) -> int | None:
        """The pipeline rank that executes ``module``, or None for "its caller's rank"."""
        return self._rank.get(id(module))

    def spans_ranks(self, module: nn.Module) -> bool:
        return len(self._subtree_ranks[id(module)]) > 1

    def sequential_runs(self, seq: nn.Sequential) -> list[tuple[int, int, int | None]]:
        """(start, stop, rank) runs of consecutive children; stateless children join the run they are in."""
        runs: list[list] = []
        for i, child in enumerate(seq):
            rank = self.rank_of_module(child)
            stateless = not self._subtree_ranks[id(child)]
            if runs and (rank == runs[-1][2] or (stateless and runs[-1][2] is not None)):
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, None if stateless else rank])
        return [(start, stop, rank) for start, stop, rank in runs]

    def _owned(self, pp_rank: int, kind: str) -> list[tuple[str, torch.Tensor]]:
        items = []
        for name, module in zip(self.names, self.modules):
            if self.plan.rank_of(name) != pp_rank:
                continue
            tensors = module._parameters if kind == "param" else module._buffers
            prefix = f"{name}." if name else ""
            items += [(prefix + k, t) for k, t in tensors.items() if t is not None]
        return items

    def local_named_parameters(self, pp_rank: int) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters, each once, named as ``root.named_parameters()`` names them."""
        canonical = {id(p): n for n, p in self.modules[0].named_parameters()}
        seen = set()
        out = []
        for _, p in self._owned(pp_rank, "param"):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((canonical[id(p)], p))
        return out

    def local_named_buffers(self, pp_rank: int) -> list[tuple[str, torch.Tensor]]:
        canonical = {id(b): n for n, b in self.modules[0].named_buffers()}
        return [(canonical.get(id(b), n), b) for n, b in self._owned(pp_rank, "buffer")]

    def release_non_local(self, pp_rank: int, device: torch.device) -> None:
        """Free other ranks' parameters and buffers here; move this rank's to ``device``."""
        local = {id(p) for _, p in self._owned(pp_rank, "param")}
        local |= {id(b) for _, b in self._owned(pp_rank, "buffer")}
        with torch.no_grad():
            for module in self.modules:
                for tensors in (module._parameters, module._buffers):
                    for key, t in tensors.items():
                        if t is None:
                            continue
                        if id(t) in local:
                            t.data = t.data.to(device)
                        elif t.is_meta:  # never materialized (delayed initialization)
                            replace_in_place(t, torch.empty(0, dtype=t.dtype, device=device))
                        else:
                            t.data = torch.empty(0, dtype=t.dtype, device=device)
