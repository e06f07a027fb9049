"""smp.amp.GradScaler with shard_optimizer_state: every data-parallel rank skips or steps together.

Each rank's optimizer holds only its share, so ``unscale_`` finds an inf only if it lies in this rank's
share; the found-inf flag must be agreed by every share (not only the pipeline), or the rank that found
it skips the step while the others step and broadcast, and the replicas diverge (or collectives mismatch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from smp_compat.testing import run_ranks


def _train() -> dict:
    import smp_compat as smp

    smp.init({"microbatches": 1, "ddp": True, "shard_optimizer_state": True})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler()
    step_index = [0]
    # net[4].weight is in dp rank 1's share (shares are greedy by size: rank 0 gets only net[2].weight)
    net[4].weight.register_hook(lambda g: g * float("inf") if step_index[0] == 1 else g)

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    g = torch.Generator().manual_seed(1)
    unchanged, scales = [], []
    for _ in range(3):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        opt.zero_grad()
        train_step(model, x, y)
        before = [p.detach().clone() for p in net.parameters()]
        scaler.step(opt)
        scaler.update()
        unchanged.append(all(torch.equal(b, p) for b, p in zip(before, net.parameters())))
        scales.append(scaler.get_scale())
        step_index[0] += 1
    owns_inf = any(p is net[4].weight for group in opt.param_groups for p in group["params"])
    return {"unchanged": unchanged, "scales": scales, "owns_inf": owns_inf,
            "params": [p.detach().clone() for p in net.parameters()]}  # fmt: skip


def test_an_overflow_in_one_share_skips_the_step_on_every_data_parallel_rank() -> None:
    rank0, rank1 = run_ranks(_train, 2, timeout=60)
    assert [rank0["owns_inf"], rank1["owns_inf"]] == [False, True]
    for r in (rank0, rank1):
        assert r["unchanged"] == [False, True, False]
        assert r["scales"][1] == r["scales"][0] / 2
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)  # replicas stay identical
