"""Outside forward and backward, a façade model's registered parameters are the ones its optimizer holds.

FSDP1 with ``use_orig_params`` (what SMP's scripts build) keeps one ``nn.Parameter`` object per weight for
the model's whole life; unsharding only changes what it views. FSDP2 instead registers *another* object
while a module is unsharded (a plain full-size tensor, or a tp-only DTensor, in place of the data-parallel
DTensor the optimizer was built with) and puts the sharded one back when it reshards. A backward reshards
every unit; a forward with no backward (evaluation under ``torch.no_grad``, or a forward whose loss is
dropped) does not reshard the root (FSDP1's choice, kept by the façade: ``reshard_after_forward=False``
for the root, and for every unit under ``NO_SHARD`` / ``SHARD_GRAD_OP`` / ``_HYBRID_SHARD_ZERO2``). Then
``model.named_parameters()`` and ``optimizer.param_groups`` disagree, and everything that matches them by
identity breaks: torch's ``get_optimizer_state_dict`` (under ``FSDP.optim_state_dict``) raises
``KeyError: 0`` for the first root parameter (issue 39, item 1).

So the façade reshards the whole tree (1) after every forward that runs with gradients disabled, when no
backward can follow, and (2) before each state-dict and optimizer-state-dict call, for a forward with
gradients on that no backward followed. A training step is unchanged: the root stays unsharded from its
forward to its backward, as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["install", "reshard_tree"]


def reshard_tree(module: nn.Module) -> None:
    """Register every FSDP2 unit's sharded parameters in ``module``'s tree (free the unsharded ones).

    A no-op for units already sharded (before the first forward, after a backward)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def install(root: nn.Module) -> None:
    """After a forward of the façade root with gradients disabled, reshard the tree (runs after FSDP2's
    own post-forward hook, which was registered first)."""
    root.register_forward_hook(_after_forward)


def _after_forward(module: nn.Module, _args: Any, _output: Any) -> None:
    if not torch.is_grad_enabled():
        reshard_tree(module)
