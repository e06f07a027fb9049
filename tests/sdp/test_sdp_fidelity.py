"""Sharded data parallelism trains exactly like plain PyTorch on the global batch (fp32, CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
from sdp_helpers import assert_close_to, init_sdp, reference, train

from smp_compat.testing import run_ranks


def _run(sdp: int, microbatches: int = 1, clip: float | None = None) -> tuple[list[float], dict, list[float]]:
    extra = {"microbatches": microbatches} | ({} if clip is None else {"sdp_gradient_clipping": clip})
    smp, model, opt = init_sdp(sdp, **extra)
    losses, norms = train(smp, model, opt)
    return losses, model.state_dict(), norms


@pytest.mark.parametrize(
    ("world", "sdp", "microbatches", "clip"),
    [(2, 2, 1, None), (4, 4, 2, 0.25), (4, 2, 1, 0.25)],
    ids=["sdp2-default-clip", "sdp4-mb2-clip0.25", "two-replicas-of-sdp2"],
)
def test_sdp_matches_plain_pytorch(world: int, sdp: int, microbatches: int, clip: float | None) -> None:
    ref = reference(clip=1.0 if clip is None else clip)
    for losses, params, norms in run_ranks(_run, world, sdp, microbatches, clip, timeout=180):
        assert_close_to(ref, losses, params, norms)


def test_clipping_at_0_25_really_changes_the_run() -> None:
    """Guards the test above: the clipped and unclipped references differ, so clipping is exercised."""
    clipped, unclipped = reference(clip=0.25), reference(clip=1.0)
    assert min(clipped[2]) > 0.25
    assert not torch.allclose(clipped[1]["blocks.0.mlp.0.weight"], unclipped[1]["blocks.0.mlp.0.weight"])


def _accumulate(sdp: int) -> tuple[list[float], dict, list[float]]:
    import smp_compat as smp
    from models import lm_loss, make_batches, make_model, causal_mask

    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": sdp})
    model = smp.DistributedModel(make_model(), backward_passes_per_step=2)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    mask = causal_mask(8)

    @smp.step
    def step(model, x, y):  # type: ignore[no-untyped-def]
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss / 2)  # the user scales by 1 / backward_passes_per_step, as HF does
        return loss

    per = 16 // smp.dp_size()
    lo = smp.dp_rank() * per
    losses, norms, synced = [], [], []
    for i, (x, y) in enumerate(make_batches(4, 16)):
        out = step(model, x[lo : lo + per], y[lo : lo + per])
        losses.append(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / smp.dp_size())
        held = sum(p.grad.to_local().numel() for p in model.parameters() if p.grad is not None)
        synced.append(held / sum(p.numel() for p in model.parameters()))
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
            norms.append(opt._global_grad_norm)
    return losses, model.state_dict(), norms, synced


@pytest.mark.parametrize(("world", "sdp"), [(2, 2), (4, 2)], ids=["sdp2", "two-replicas-of-sdp2"])
def test_backward_passes_per_step_accumulates_sharded_gradients_then_matches(world: int, sdp: int) -> None:
    """As SMP: every pass reduce-scatters (gradients stay at 1/sdp per rank), replicas all-reduce at the boundary."""
    ref = reference(accumulate=2)
    for losses, params, norms, sharded in run_ranks(_accumulate, world, sdp, timeout=180):
        # between passes an HSDP rank keeps the reduce-scattered shard inside FSDP2 (p.grad is still None);
        # no rank ever holds more than its 1/sdp of the gradients
        assert sharded[1] == sharded[3] == pytest.approx(1 / sdp)
        assert sharded[0] == sharded[2] == (pytest.approx(1 / sdp) if world == sdp else 0)
        # blocks.1.mlp.2.weight[14, 28] gets a gradient of -9e-8 (mean |g| 3e-3) in the first accumulated step: AdamW
        # turns its summation-order noise into a step of ~lr, ~5e-6 apart. A wrong reduction moves every element.
        assert_close_to(ref, losses, params, norms, param_atol=5e-5)


def _per_rank_sizes(sdp: int) -> dict[str, int]:
    smp, model, opt = init_sdp(sdp)
    train(smp, model, opt, steps=1)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    sizes = {"params": 0, "grads": 0, "optimizer": 0, "full": 0}
    for p in model.parameters():
        sizes["full"] += p.numel()
        sizes["params"] += local(p).numel()
        sizes["grads"] += local(p.grad).numel()
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                sizes["optimizer"] += local(value).numel()
    return sizes


@pytest.mark.parametrize("sdp", [2, 4])
def test_gradients_and_optimizer_state_per_rank_are_one_over_sdp(sdp: int) -> None:
    for sizes in run_ranks(_per_rank_sizes, 4, sdp, timeout=180):
        full = sizes["full"]
        assert sizes["params"] == pytest.approx(full / sdp, rel=0.02)
        assert sizes["grads"] == pytest.approx(full / sdp, rel=0.02)
        assert sizes["optimizer"] == pytest.approx(2 * full / sdp, rel=0.02)  # AdamW: exp_avg and exp_avg_sq
