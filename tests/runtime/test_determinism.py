"""deterministic_server: pipelined runs repeat bit for bit, and a resumed run equals the uninterrupted one."""

from __future__ import annotations

import torch

from models import causal_mask, lm_loss, make_batches, make_model, place_blocks_by_stage, reference_training
from smp_compat.testing import run_ranks

STEPS, BATCH = 3, 8


def _run(path: str, steps: range, save_after: int | None, resume: bool, nested: bool = False) -> dict[str, torch.Tensor]:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
              "deterministic_server": True})  # fmt: skip
    model = smp.DistributedModel(make_model())
    place_blocks_by_stage(smp, model)
    if nested:  # rank 0 -> 1 -> 0 -> 1: block 2 on rank 1 calls its mlp back on rank 0
        smp.set_partition(model.module.blocks[2], 1)
        smp.set_partition(model.module.blocks[2].mlp, 0)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    if resume:
        smp.resume_from_checkpoint(path)
    mask = causal_mask(8)

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    batches = make_batches(STEPS, BATCH)
    for i in steps:
        opt.zero_grad()
        train_step(model, *batches[i])
        opt.step()
        if save_after == i:
            smp.save_checkpoint(path, tag=f"step{i}", model=model, optimizer=opt)
    return {n: p.detach().clone() for n, p in model.local_named_parameters()}


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(torch.equal(x[n], y[n]) for x, y in zip(a, b) for n in x)


def test_runs_repeat_bitwise_and_match_plain_pytorch(tmp_path) -> None:
    first = run_ranks(_run, 2, str(tmp_path), range(STEPS), None, False, timeout=90)
    second = run_ranks(_run, 2, str(tmp_path), range(STEPS), None, False, timeout=90)
    assert _same(first, second)
    _, ref = reference_training(STEPS, BATCH)
    for params in first:
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6)


def test_a_nested_call_chain_repeats_bitwise(tmp_path) -> None:
    """Gradient replies used to be taken in batches as they arrived; the batching changed how a shared leaf's
    gradients were summed (runs differed by ~5e-7). Now one reply per segment, in request order."""
    runs = [run_ranks(_run, 2, str(tmp_path), range(STEPS), None, False, True, timeout=90) for _ in range(3)]
    assert all(_same(runs[0], other) for other in runs[1:])
    _, ref = reference_training(STEPS, BATCH)
    for params in runs[0]:
        for name, value in params.items():
            torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6)


def test_resume_with_four_microbatches_is_bitwise(tmp_path) -> None:
    straight = run_ranks(_run, 2, str(tmp_path / "a"), range(STEPS), None, False, timeout=90)
    run_ranks(_run, 2, str(tmp_path / "b"), range(2), 1, False, timeout=90)
    resumed = run_ranks(_run, 2, str(tmp_path / "b"), range(2, STEPS), None, True, timeout=90)
    assert _same(straight, resumed)


class _DropoutAroundStage(torch.nn.Module):
    """Dropout on rank 0 before and after a remote stage that has its own: the draws of rank 0's microbatches
    interleave differently with one and with four microbatches in flight."""

    def __init__(self) -> None:
        import smp_compat as smp

        super().__init__()
        self.inp, self.out = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        with smp.partition(1):
            self.mid = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.mid(self.drop(self.inp(x)))))


def _run_dropout(in_flight: int, pipeline: str) -> dict[str, object]:
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
              "deterministic_server": True, "active_microbatches": in_flight, "pipeline": pipeline})  # fmt: skip
    torch.manual_seed(0)
    model = smp.DistributedModel(_DropoutAroundStage())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
        opt.zero_grad()
        losses.append(train_step(model, x, y).reduce_mean())
        opt.step()
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"losses": torch.stack(losses), "params": params, "after": torch.rand(3)}


def test_dropout_masks_do_not_depend_on_the_order_tasks_run_in() -> None:
    one = run_ranks(_run_dropout, 2, 1, "simple", timeout=90)
    four = run_ranks(_run_dropout, 2, 4, "interleaved", timeout=90)
    for a, b in zip(one, four):
        assert torch.equal(a["losses"], b["losses"]), (a["losses"], b["losses"])
        assert _same([a["params"]], [b["params"]])
        assert torch.equal(a["after"], b["after"])  # the caller's own generator went on the same way
