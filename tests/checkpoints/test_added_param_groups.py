"""``optimizer.add_param_group`` after ``smp.DistributedOptimizer``: the group is in every optimizer dict.

Full dicts used to list only the groups present at wrapping, silently dropping the added group's state, and
loading such a dict failed inside torch. Compared with plain PyTorch's own ``state_dict()``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from models import lm_train_step, make_model, place_blocks_by_stage, plain_training, train_smp
from smp_compat.testing import run_ranks

STEPS, BATCH = 2, 4


def _split(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The blocks (spread over both pipeline stages) go in the added group, the rest in the first."""
    named = list(module.named_parameters())
    return [p for n, p in named if not n.startswith("blocks.")], [p for n, p in named if n.startswith("blocks.")]


def _add_blocks(opt: Any, module: nn.Module) -> Any:
    opt.add_param_group({"params": _split(module)[1], "lr": 5e-3})
    return opt


def _plain_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    return _add_blocks(torch.optim.Adam(_split(module)[0], lr=1e-2), module)


def _train_with_added_group(pp: int) -> dict[str, Any]:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(make_model())
    if pp > 1:
        place_blocks_by_stage(smp, model)
    opt = _add_blocks(smp.DistributedOptimizer(torch.optim.Adam(_split(model.module)[0], lr=1e-2)), model.module)
    train_smp(smp, model, opt, lm_train_step(smp), STEPS, BATCH)
    full = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(full)  # failed in torch: "different number of parameter groups"
    return {"full": full, "reloaded": opt.state_dict(), "local": opt.local_state_dict()}


@pytest.mark.parametrize("pp", [1, 2])
def test_added_group_is_in_the_full_dict_as_in_plain_pytorch(pp: int) -> None:
    expected = plain_training(STEPS, BATCH, _plain_optimizer)[2].state_dict()
    for r in run_ranks(_train_with_added_group, pp, pp, timeout=60):
        assert len(r["local"]["param_groups"]) == 2
        for sd in (r["full"], r["reloaded"]):
            assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in expected["param_groups"]]
            assert [g["lr"] for g in sd["param_groups"]] == [1e-2, 5e-3]
            assert sorted(sd["state"]) == sorted(expected["state"])
            for index, value in expected["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(sd["state"][index][key], value[key], rtol=1e-5, atol=1e-6)
