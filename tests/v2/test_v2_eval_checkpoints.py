"""Evaluation, then a checkpoint (issue 39, item 1), for each of AWS's five v2 checkpoint types.

AWS's notebooks set ``validation_freq`` = ``checkpoint_freq``: train_lib.py evaluates (``model.eval()``,
``torch.no_grad()``) and then saves. That forward has no backward, so FSDP2 leaves the root's unsharded
parameters registered and ``FSDP.optim_state_dict`` raised ``KeyError: 0`` on every rank
(smp_compat/v2/fsdp/reshard.py has the cause). Each test runs the scripts' loop (v2ckpt_eval.py: evaluate and
save every 2 steps of 4) and a new job in a fresh container that resumes from step 2: its losses, its
evaluations and its final weights equal the straight run's bit for bit (``full`` holds weights only: the
loaded weights equal the saved ones and evaluate to the same loss). Cases marked ``+dropped`` also run a
forward with gradients and no backward before each save. At tp 1 the straight run's losses also equal
one-process PyTorch's: neither the evaluations nor the saves change the training.

The default run covers each type at one layout (the notebooks' tp 2 x hsd 2 for ``sharded``), all five cases in
one straight job and one resume job (an exception names its case); the slow tests cover every layout each type
supports: hsd 0/1/2, tp 2, tp 2 x cp 2, ep 2 (``local`` refuses tp > 1 in the scripts themselves). Without
the fix the straight job fails with ``KeyError: 0`` in ``sharded`` and ``async_sharded`` (``local``,
``async_local`` and ``full`` read the parameters through FSDP2's own state-dict hooks and passed before).
"""

from __future__ import annotations

import fsdp_job
import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, before the ranks fork: see test_v2_checkpoints.py)
import transformers
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.mixtral.modeling_mixtral  # noqa: F401
from v2ckpt_eval import EVERY, LAYOUTS, Case, jobs

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.hf

DEFAULT = {
    "sharded": [Case("sharded", "tp2")],
    "async_sharded": [Case("async_sharded", "hsd0", dropped=True)],
    "local": [Case("local", "hsd1", dropped=True)],
    "async_local": [Case("async_local", "hsd2")],
    "full": [Case("full", "tp2")],
}
SLOW = {
    "sharded": [Case("sharded", x) for x in ("hsd1", "hsd0", "ep2")]
    + [Case("sharded", "hsd2", dropped=True), Case("sharded", "tp2cp2", dropped=True)],
    "async_sharded": [Case("async_sharded", x) for x in ("hsd2", "tp2", "tp2cp2", "ep2")]
    + [Case("async_sharded", "hsd1", dropped=True)],
    "local": [Case("local", "hsd0"), Case("local", "hsd2"), Case("local", "ep2", dropped=True)],
    "async_local": [Case("async_local", x) for x in ("hsd0", "hsd1", "tp2", "ep2")]
    + [Case("async_local", "tp2cp2", dropped=True)],
    "full": [Case("full", x) for x in ("hsd2", "hsd1", "hsd0", "ep2", "tp2cp2")],
}


# Layouts the installed transformers serves (CI also runs -m hf at the oldest supported one): ep 2 builds Mixtral
# through transform(config=MoEConfig()), which needs transformers 5 (as test_moe_ep.py skips); context
# parallelism needs the AttentionInterface of transformers >= 4.48 (as test_context_parallel.py skips).
SERVED = set(LAYOUTS) - ({"ep2"} if int(transformers.__version__.split(".")[0]) < 5 else set()) - (
    set() if hasattr(transformers, "AttentionInterface") else {"tp2cp2"})


def _tp1_llama(case: Case) -> bool:
    return case.layout in ("hsd0", "hsd1", "hsd2")


def _runs(cases: list[Case], tmp_path) -> list[tuple[dict, dict]]:
    """Rank 0's (straight, resumed) results of each case: two jobs, the cases one after another in each."""
    root, timeout = str(tmp_path / "checkpoints"), 120 + 60 * len(cases)
    straight = run_ranks(jobs, 4, "straight", cases, root, str(tmp_path / "home1"), timeout=timeout)
    resumed = run_ranks(jobs, 4, "resume", cases, root, str(tmp_path / "home2"), timeout=timeout)
    return list(zip(straight[0], resumed[0]))


def _check(case: Case, whole: dict, again: dict) -> None:
    if case.kind == "full":
        saved, loaded = whole["saved"], again["loaded"]
        assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved), case
        assert again["evals"][EVERY] == whole["evals"][EVERY], case
    else:
        assert again["losses"] == whole["losses"][EVERY:], case
        assert again["evals"] == {k: v for k, v in whole["evals"].items() if k > EVERY}, case
        assert fsdp_job.max_diff(whole["params"], again["params"]) == 0.0, case
    if _tp1_llama(case):
        reference = fsdp_job.reference_training(dp=4, steps=len(whole["losses"]))[0]
        torch.testing.assert_close(whole["losses"], reference, rtol=0, atol=1e-5, msg=str(case))


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory) -> dict[Case, tuple[dict, dict]]:
    """Every type's default cases in one straight job and one resume job (forks and inits paid twice, not ten
    times; about 40 s less on this 2-core machine)."""
    cases = [case for kind in DEFAULT for case in DEFAULT[kind]]
    return dict(zip(cases, _runs(cases, tmp_path_factory.mktemp("default"))))


@pytest.mark.parametrize("kind", list(DEFAULT))
def test_checkpoint_after_evaluation_resumes_as_the_straight_run(default_runs, kind: str) -> None:
    for case in DEFAULT[kind]:
        _check(case, *default_runs[case])


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SLOW))
def test_checkpoint_after_evaluation_at_every_layout(tmp_path, kind: str) -> None:
    served = [c for c in SLOW[kind] if c.layout in SERVED]
    for case, (whole, again) in zip(served, _runs(served, tmp_path)):
        _check(case, whole, again)
    covered = {c.layout for c in DEFAULT[kind] + SLOW[kind]}
    assert covered == set(LAYOUTS) - ({"tp2", "tp2cp2"} if kind == "local" else set())
