"""Which modules become FSDP2 units: blocks of ModuleLists, shared parameters kept in one unit (no process group)."""

from __future__ import annotations

import pytest
import torch
from models import make_model
from torch import nn

from smp_compat.sdp import wrap


@pytest.fixture(autouse=True)
def _no_registrations() -> None:
    wrap._registered.clear()


def test_blocks_of_a_module_list_are_units_and_the_tied_embedding_stays_in_the_root() -> None:
    model = make_model()
    units = wrap.choose_units(model)
    assert units == list(model.blocks)
    assert all(model.embed is not u and model.head is not u for u in units)


class _Borrowing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        x = torch.nn.functional.linear(self.layers[1](x), self.layers[0].weight)  # layers[1] borrows a weight
        return self.layers[2](x)


def test_register_parameter_keeps_the_borrower_and_the_owner_out_of_separate_units() -> None:
    model = _Borrowing()
    assert wrap.choose_units(model) == list(model.layers)
    wrap.register_parameter(model.layers[1], model.layers[0].weight)
    assert wrap.choose_units(model) == [model.layers[2]]  # layers 0 and 1 go to the root unit together


def test_a_parameter_shared_between_two_blocks_leaves_both_to_the_root() -> None:
    blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])
    blocks[2].weight = blocks[0].weight
    root = nn.Sequential()
    root.blocks = blocks
    assert wrap.choose_units(root) == [blocks[1]]


def test_without_a_module_list_the_children_with_parameters_are_units() -> None:
    root = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert wrap.choose_units(root) == [root[0], root[2]]
