"""A step that fails and is caught by the script leaves the pipeline clean: later steps train exactly like plain
PyTorch that skipped the failed batch, and every rank raises the step's error.

Before the fix, the failed step's other microbatches stayed queued on every rank. With one microbatch, the
next step on rank 1 silently returned rank 0's outputs of the step after; with more, rank 1 hung.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from models import causal_mask, fail_in_backward, lm_loss, make_batches, make_model, place_blocks_by_stage
from smp_compat.stepping.step import current_microbatch
from smp_compat.testing import run_ranks

STEPS, GLOBAL_BATCH, FAILING_STEP = 4, 8, 1
_FAILING = [False]  # set by the training loop for the failing step, read by the fault


def _faulty_here(fault_mb: int) -> bool:
    return _FAILING[0] and current_microbatch() == fault_mb


def _install_module_fault(model: Any, fault: str, fault_mb: int) -> None:
    """A fault inside the last block (on the last pipeline rank), in forward or in backward."""

    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not _faulty_here(fault_mb):
            return output
        if fault == "module_forward":
            raise ValueError("the last block failed on purpose")
        return fail_in_backward(output, RuntimeError("backward exploded"))

    model.module.blocks[-1].ln2.register_forward_hook(hook)


def _train(config: dict, fault: str, fault_mb: int, failing_step: int = FAILING_STEP) -> dict:
    import smp_compat as smp

    smp.init(config)
    model = smp.DistributedModel(make_model())
    if not config["auto_partition"]:
        place_blocks_by_stage(smp, model)
    if fault.startswith("module"):
        _install_module_fault(model, fault, fault_mb)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    mask = causal_mask(8)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x, attention_mask=mask), y)
        if fault == "body_before_backward" and _faulty_here(fault_mb):
            raise KeyError("the step body failed on purpose")
        model.backward(loss)
        if fault == "body_after_backward" and _faulty_here(fault_mb):
            raise KeyError("the step body failed on purpose")
        return loss

    losses, raised = [], []
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
        _FAILING[0] = step == failing_step
        opt.zero_grad()
        try:
            out = train_step(model, x, y)
        except Exception as exc:  # noqa: BLE001 - the script skips the batch, as an OOM-skipping loop would
            raised.append((step, type(exc).__name__, " ".join(getattr(exc, "__notes__", []))))
            continue
        opt.step()
        losses.append(out.reduce_mean().item())
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    return {"losses": losses, "raised": raised, "params": params}


def _reference(failing_step: int = FAILING_STEP) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the global batch, skipping the failed step's batch."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(make_batches(STEPS, GLOBAL_BATCH)):
        if step == failing_step:
            continue
        opt.zero_grad()
        loss = lm_loss(model(x, attention_mask=causal_mask(8)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = [
    # (pp, microbatches, pipeline, fault, microbatch that fails, extra config)
    (2, 1, "interleaved", "body_before_backward", 0, {}),  # was silent: rank 1 returned the next step's outputs
    (2, 4, "interleaved", "body_before_backward", 2, {}),  # was a hang on rank 1
    (2, 4, "simple", "body_after_backward", 1, {}),
    (2, 4, "interleaved", "module_forward", 1, {}),
    (2, 4, "interleaved", "module_backward", 3, {"deterministic_server": True}),
    (3, 4, "interleaved", "body_after_backward", 2, {}),
    (3, 2, "simple", "module_backward", 0, {}),
]


@pytest.mark.parametrize(("pp", "mb", "pipeline", "fault", "fault_mb", "extra"), CASES)
def test_a_caught_step_failure_leaves_the_pipeline_training_like_plain_pytorch(
    pp: int, mb: int, pipeline: str, fault: str, fault_mb: int, extra: dict
) -> None:
    config = {"pipeline_parallel_degree": pp, "microbatches": mb, "pipeline": pipeline, "auto_partition": False,
              "default_partition": 0, **extra}  # fmt: skip
    results = run_ranks(_train, pp, config, fault, fault_mb, timeout=120, env={"SMP_PIPELINE_TIMEOUT_S": "30"})
    _check(results, "KeyError" if fault.startswith("body") else "RemoteError", FAILING_STEP)


def test_a_failure_in_the_first_steps_trace_is_raised_on_every_rank() -> None:
    """With auto_partition, rank 0 runs microbatch 0 of the first step alone to plan the partition. An error
    there used to reach only rank 0: rank 1 took the next step's plan for this one and ran a step behind."""
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "interleaved", "auto_partition": True}
    results = run_ranks(_train, 2, config, "body_before_backward", 0, 0, timeout=120,
                        env={"SMP_PIPELINE_TIMEOUT_S": "30"})  # fmt: skip
    _check(results, "KeyError", 0)


def _check(results: list[dict], expected_type: str, failing_step: int) -> None:
    ref_losses, ref_params = _reference(failing_step)
    merged: dict[str, torch.Tensor] = {}
    for rank, r in enumerate(results):
        assert [(s, kind) for s, kind, _ in r["raised"]] == [(failing_step, expected_type)], (rank, r["raised"])
        notes = r["raised"][0][2]
        assert ("raised on rank 0" in notes) == (rank > 0), (rank, notes)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        merged.update(r["params"])
    assert set(merged) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
