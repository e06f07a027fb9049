"""Pipeline traffic: results rank 0 only passes on stay remote, so bytes moved ~ bytes that must cross."""

from __future__ import annotations

from typing import Any

from models import causal_mask, lm_loss, make_batches, make_model, place_blocks_by_stage
from smp_compat.testing import run_ranks

MICROBATCHES, BATCH, SEQ, WIDTH = 4, 8, 8, 16


def _pipelined_lm() -> tuple[Any, Any]:
    """pp = 2 model (blocks 2, 3 and ln_f on rank 1; the tied head on rank 0) and its training step."""
    import smp_compat as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES, "auto_partition": False,
              "default_partition": 0})  # fmt: skip
    model = smp.DistributedModel(make_model())
    place_blocks_by_stage(smp, model)
    mask = causal_mask(SEQ)

    @smp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    return model, train_step


def _bytes_per_step() -> list[int]:
    model, train_step = _pipelined_lm()
    sent = []
    for x, y in make_batches(3, BATCH):
        before = model.pipeline_engine.bytes_sent if model.pipeline_engine else 0
        train_step(model, x, y)
        sent.append(model.pipeline_engine.bytes_sent - before)
    return sent


def test_bytes_per_microbatch_match_the_partition_boundary() -> None:
    per_rank = run_ranks(_bytes_per_step, 2, timeout=60)
    hidden = BATCH // MICROBATCHES * SEQ * WIDTH * 4
    # per microbatch: hidden state to rank 1, ln_f output back, and one gradient each way; the mask once
    must_cross = 4 * hidden + SEQ * SEQ * 4
    losses_to_other_ranks = 4  # end of step: one fp32 loss per microbatch (per step, spread here)
    for step in (1, 2):  # the first step learns which results are only passed on
        moved = (per_rank[0][step] + per_rank[1][step]) / MICROBATCHES
        assert moved <= 1.1 * must_cross + losses_to_other_ranks, (step, moved, must_cross)


def _send_buffers_held_after_steps(steps: int) -> tuple[int, int]:
    model, train_step = _pipelined_lm()
    for x, y in make_batches(steps, BATCH):
        train_step(model, x, y)
    transport = model.pipeline_engine.transport
    held = sum(len(out._in_flight) + len(out._free) for out in transport._outgoing.values())
    return held, transport.messages


def test_send_buffers_are_reused_not_kept_for_the_engines_lifetime() -> None:
    # gloo marks a send complete only in wait(): polling is_completed() alone kept every buffer (a leak of
    # all pipeline traffic, and fresh pages for every message)
    for held, messages in run_ranks(_send_buffers_held_after_steps, 2, 20, timeout=90):
        assert messages >= 20 * MICROBATCHES * 2
        assert held <= 6, (held, messages)
