"""End to end: the pipeline examples run through ``smp-compat run`` and train exactly like plain PyTorch.

Each example saves its losses, eval results and final parameters with ``--out``; the oracle is the same
model trained in this process on the global batch. Launch helpers come from tests/launching.py.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from launching import ROOT, clean_env, free_port, run_all, smp_compat_command

EXAMPLES = ROOT / "examples"
PIPELINE = EXAMPLES / "train_pipeline.py"
HYBRID = EXAMPLES / "train_hybrid.py"
PP2 = EXAMPLES / "configs" / "pp2.json"
PP2_DP2 = EXAMPLES / "configs" / "pp2_dp2.json"
README_COMMAND = "smp-compat run --nproc-per-node 2 --config examples/configs/pp2.json examples/train_pipeline.py"
STEPS, GLOBAL_BATCH, LR = 4, 16, 3e-3
MANUAL_STAGE_1 = {"blocks.2", "blocks.3", "ln_f"}
PARAM_ATOL = 5e-5
"""Adam divides by sqrt(v) + 1e-8: a gradient whose true value is ~0 (one key weight here gets 1.8e-8 at step 0)
becomes a step of up to lr, decided by float summation noise, so that element ends ~1e-5 off. A real error
(a missing or doubled gradient) moves parameters by ~lr = 3e-3 per step; the losses are compared at 1e-5."""


def _load_pipeline_example() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("train_pipeline_example", PIPELINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Plain single-process PyTorch on the global batch, with the example's own model, data and eval."""
    example = _load_pipeline_example()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs; also the fastest for this size
    try:
        return _train_reference(example)
    finally:
        torch.set_num_threads(threads)


def _train_reference(example: types.ModuleType) -> dict[str, Any]:
    model = example.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in example.make_batches(STEPS, GLOBAL_BATCH):
        optimizer.zero_grad()
        loss = example.lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    x, y = example.make_batches(1, GLOBAL_BATCH, seed=2)[0]
    model.eval()
    with torch.no_grad():
        logits = model(x)
    return {
        "losses": losses,
        "eval_loss": example.lm_loss(logits, y).item(),
        "eval_logits": logits,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _launch(tmp_path: Path, script: Path, config: Path, *extra: str, nproc: int | None = None) -> dict[str, Any]:
    """Run one example as a job of ``smp-compat run`` (hard timeout from run_all) and load its --out file."""
    out = tmp_path / "result.pt"
    nproc_args = ["--nproc-per-node", str(nproc)] if nproc else []  # else: the config's processes_per_host
    cmd = [*smp_compat_command(), "run", *nproc_args, "--master-port", str(free_port()), "--config", str(config),
           str(script), "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH), "--lr", str(LR),
           "--out", str(out), *extra]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    return torch.load(out)


def _check_training(result: dict[str, Any], reference: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["eval_loss"], reference["eval_loss"], rtol=1e-5, atol=1e-6)
    assert result["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        got = result["params"][name]
        torch.testing.assert_close(got, value, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")


def _stage(plan: dict[str, int], pp_rank: int) -> set[str]:
    return {unit for unit, rank in plan.items() if rank == pp_rank}


def test_readme_main_command_names_the_pipeline_example() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert README_COMMAND in readme
    for word in README_COMMAND.split():
        if word.startswith("examples/"):
            assert (ROOT / word).is_file(), word


def test_pipeline_example_auto_partition_matches_plain_pytorch(tmp_path: Path, reference: dict[str, Any]) -> None:
    result = _launch(tmp_path, PIPELINE, PP2, nproc=2)  # the README's main command, plus test options
    _check_training(result, reference)
    torch.testing.assert_close(result["eval_logits"], reference["eval_logits"], rtol=1e-5, atol=1e-5)
    assert (result["world_size"], result["pp_size"], result["dp_size"]) == (2, 2, 1)
    assert result["smp_import"] == "smdistributed.modelparallel.torch"  # unmodified script, through the shim
    assert result["config"]["auto_partition"] is True and result["config"]["microbatches"] == 4
    plan = result["plan"]
    assert _stage(plan, 0) and _stage(plan, 1), plan  # both stages hold part of the model
    assert plan["wte"] == plan["lm_head"] == 0, plan  # tied weights together, with the root on stage 0


def test_pipeline_example_manual_partition_matches_plain_pytorch(tmp_path: Path, reference: dict[str, Any]) -> None:
    result = _launch(tmp_path, PIPELINE, PP2, "--partition", "manual", nproc=2)
    _check_training(result, reference)
    assert result["config"]["auto_partition"] is False  # the script's dict; the launcher's config left it out
    plan = result["plan"]
    assert _stage(plan, 1) == MANUAL_STAGE_1, plan  # smp.partition blocks in __init__ plus set_partition(ln_f)
    assert _stage(plan, 0) == {"wte", "wpe", "blocks.0", "blocks.1", "lm_head"}, plan


@pytest.mark.slow  # 12-18 s: CI's slow step runs it (the default run stays under 10 minutes)
def test_hybrid_example_pp2_dp2_matches_plain_pytorch(tmp_path: Path, reference: dict[str, Any]) -> None:
    result = _launch(tmp_path, HYBRID, PP2_DP2)  # 4 processes from the config's processes_per_host
    _check_training(result, reference)
    assert (result["world_size"], result["pp_size"], result["dp_size"]) == (4, 2, 2)
    assert result["config"]["ddp"] is True
    assert _stage(result["plan"], 0) and _stage(result["plan"], 1)


def test_examples_keep_the_smp_import_line() -> None:
    """Both scripts are SMP scripts: they import smdistributed first and fall back to smp_compat."""
    for script in (PIPELINE, HYBRID):
        text = script.read_text(encoding="utf-8")
        assert "import smdistributed.modelparallel.torch as smp" in text, script
        assert "import smp_compat as smp" in text, script
