"""``shard_optimizer_state``: ZeRO-1 over the reduced-data-parallel (rdp) group.

Every rdp rank holds the same (averaged) gradients after a step call; each keeps optimizer state for
only its share of this rank's local parameters, steps only those, then broadcasts them, so parameters
stay identical across replicas while optimizer memory per rank drops to about 1/rdp. Shares are
decided after partitioning (which decides what is local), greedily by size, the same way on every rank.

The group is SMP's: the ranks that hold the same parameters. Without tensor parallelism it is the whole
data-parallel group (rdp = dp). With it, each tp rank's shards are split among its rdp group, and so are
the replicated (non-distributed) parameters: every tp rank steps the same share of them from the same
averaged gradients, identically, so they stay equal across the tp group without extra traffic, at 1/rdp
(not 1/dp) of their optimizer state per rank.

With fp16/bf16 the sharding restricts the *wrapped* torch optimizer (so fp32 masters exist only for this
rank's share) but hooks ``step``/``zero_grad`` of the *outer* ``FP16Optimizer``: the shares may only be
broadcast after the wrapper has copied the updated masters into the 16-bit parameters, and every local
16-bit gradient (owned or not) must be cleared, or stale gradients enter the next data-parallel average.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from smp_compat.stepping import grads
from smp_compat.errors import SMPUnsupportedError
from smp_compat.globalstate import process_group, state

__all__ = ["OptimizerSharding"]


class OptimizerSharding:
    """Restricts an optimizer to this rank's share and re-broadcasts shares after each step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.shares: list[list[torch.nn.Parameter]] = []
        self.local: list[torch.nn.Parameter] = []
        self._outer: Any = None
        optimizer.state_dict = self._no_full_state_dict  # type: ignore[method-assign]

    def hook(self, outer: Any) -> None:
        """Wrap ``outer.step``/``outer.zero_grad``: ``outer`` is what the script steps (torch or FP16Optimizer)."""
        self._outer = outer
        self._step = outer.step
        self._zero_grad = outer.zero_grad
        # bound to ``outer``: torch's LR schedulers rebind ``outer.step.__func__`` to the optimizer they wrap
        outer.step = types.MethodType(lambda _, *args, **kwargs: self.step(*args, **kwargs), outer)
        outer.zero_grad = types.MethodType(lambda _, set_to_none=True: self.zero_grad(set_to_none), outer)

    def apply(self, model: Any) -> None:
        """Split the local parameters among the rdp ranks and drop the others from the param groups."""
        topo = state.topology
        self.local = [p for p in model.local_parameters() if p.requires_grad]
        loads = [0] * topo.rdp_size
        self.shares = [[] for _ in range(topo.rdp_size)]
        for p in sorted(self.local, key=lambda p: -p.numel()):  # stable sort: ties keep parameter order
            owner = loads.index(min(loads))
            self.shares[owner].append(p)
            loads[owner] += p.numel()
        mine = {id(p) for p in self.shares[topo.coords(state.rank).rdp_rank]}
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]
        self._drop_foreign_state(mine)

    def _drop_foreign_state(self, mine: set[int]) -> None:
        """State made before partitioning (Adagrad's in ``__init__``) for parameters now outside the groups:
        torch's ``state_dict()`` cannot index it, and its memory is what sharding saves."""
        for p in [p for p in self.optimizer.state if id(p) not in mine]:
            del self.optimizer.state[p]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Step this rank's share (through the fp16 wrapper, if any), then every owner broadcasts its share."""
        result = self._step(*args, **kwargs)
        if getattr(self._outer, "overflow", False):  # a skipped step (agreed by every rank): nothing changed
            return result
        topo = state.topology
        members = topo.get_rdp_group(state.rank)
        for rdp_rank, share in enumerate(self.shares):
            grads.broadcast_tensors([p.data for p in share], members[rdp_rank], process_group("rdp"), topo.rdp_size)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """All local gradients, not only this rank's share (the others are averaged here too)."""
        self._zero_grad(set_to_none=set_to_none)
        for p in self.local:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _no_full_state_dict(self) -> dict[str, Any]:
        raise SMPUnsupportedError(
            "a full optimizer state_dict() with shard_optimizer_state (SMP did not support it either); "
            "save each rank's local_state_dict() / use smp.save_checkpoint(partial=True)"
        )
