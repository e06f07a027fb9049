"""The RNG tracker's dropout streams (issue 35, item 4), as Megatron's tracker behaves: inside
``tsm.state.get_rng_state_tracker().fork()`` each tp rank draws its own masks, seeded from ``random_seed`` (so a
rerun draws the same ones, another seed others); outside it, the script's default stream, equal on every tp rank;
and Transformer Engine's checkpoint (the stand-in) replays a forked dropout on recomputation."""

from __future__ import annotations

from typing import Any

import torch

from smp_compat.testing import run_ranks


def _masks(seed: int) -> dict[str, Any]:
    import functools

    import torch.sagemaker as tsm
    import transformer_engine.pytorch as te

    from smp_compat.v2.state import reset

    reset()
    tsm.init({"tensor_parallel_degree": 2, "random_seed": seed})
    torch.manual_seed(42)  # the script's set_seed: the same default stream on every rank
    drop = torch.nn.Dropout(0.5)
    ones = torch.ones(64)
    tracker = tsm.state.get_rng_state_tracker()
    with tracker.fork():
        inside = [drop(ones).ne(0) for _ in range(2)]
    outside = drop(ones).ne(0)

    def block(x: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return drop(x) * x

    x = torch.linspace(1, 2, 64, requires_grad=True)
    ckpt = functools.partial(te.checkpoint, get_rng_state_tracker=tsm.state.get_rng_state_tracker,
                             distribute_saved_activations=False, tp_group=tsm.state.tp_process_group,
                             use_reentrant=False)  # fmt: skip
    state = tracker.get_states()
    ckpt(block, x).sum().backward()
    replayed = x.grad.clone()
    tracker.set_states(state)
    x.grad = None
    block(x).sum().backward()
    return {"tp_rank": tsm.state.tp_rank, "inside": torch.stack(inside), "outside": outside,
            "replay_equal": torch.equal(replayed, x.grad)}  # fmt: skip


def test_each_tp_rank_draws_its_own_reproducible_stream() -> None:
    first = run_ranks(_masks, 4, 7, timeout=240)  # tp 2 x dp 2
    again = run_ranks(_masks, 2, 7, timeout=240)  # a rerun (tp 2 alone: a stream depends on seed and tp rank only)
    other = run_ranks(_masks, 2, 8, timeout=240)
    again, other = again * 2, other * 2  # rank r of the world-4 run has tp rank r % 2
    for r in range(4):
        assert first[r]["tp_rank"] == r % 2
        assert torch.equal(first[r]["inside"], again[r]["inside"]), f"rank {r}: same seed, other masks"
        assert not torch.equal(first[r]["inside"], other[r]["inside"]), f"rank {r}: random_seed ignored"
        assert not torch.equal(first[r]["inside"][0], first[r]["inside"][1]), f"rank {r}: the stream does not advance"
        assert torch.equal(first[r]["outside"], first[0]["outside"]), f"rank {r}: default stream differs"
        assert first[r]["replay_equal"], f"rank {r}: TE checkpoint did not replay the forked dropout"
    # tp ranks differ; data-parallel peers with the same tp rank (ranks 0 and 2) draw alike, as in Megatron
    assert not torch.equal(first[0]["inside"], first[1]["inside"])
    assert torch.equal(first[0]["inside"], first[2]["inside"]) and torch.equal(first[1]["inside"], first[3]["inside"])
