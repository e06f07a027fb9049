"""The SMP v1 APIs transformers' SMP path reads, and the Trainer fixes' installation: in SMP jobs only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from launching import ROOT, clean_env
from smp_compat.shim import SITE_DIR
from smp_compat.stepping.output import StepOutput
from smp_compat.testing import run_ranks


def test_step_output_detach_gives_detached_values_that_concat() -> None:
    """transformers' ``smp_nested_concat`` calls ``step_output.detach().concat()`` on evaluation logits."""
    w = torch.ones(2, requires_grad=True)
    out = StepOutput([w * 1.0, w * 2.0])
    detached = out.detach()
    assert isinstance(detached, StepOutput) and all(not v.requires_grad for v in detached)
    assert torch.equal(detached.concat(), torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert out[0].requires_grad  # the original keeps its graph


def _translate_functions() -> dict:
    import transformers

    import smp_compat as smp

    smp.init({})
    empty_before = smp.state.module_manager.translate_functions == []
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        swapped = transformers.GPT2LMHeadModel(config)
    model = smp.DistributedModel(swapped)
    pairs = smp.state.module_manager.translate_functions
    torch.manual_seed(0)
    plain_keys = list(transformers.GPT2LMHeadModel(config).state_dict())
    smp_keys = list(model.state_dict())
    to_hf, from_hf = pairs[0]
    return {"empty_before": empty_before, "pairs": len(pairs), "smp_names": smp_keys != plain_keys,
            "to_hf": sorted(to_hf(model.state_dict())) == sorted(plain_keys),
            "round_trip": sorted(from_hf(to_hf(model.state_dict()))) == sorted(smp_keys)}  # fmt: skip


@pytest.mark.hf
def test_module_manager_translates_a_swapped_model_to_hugging_face_names() -> None:
    """``save_pretrained`` (SMP >= 1.10) runs the state dict through each ``smp_to_hf`` of
    ``smp.state.module_manager.translate_functions``: none without a swap (names are Hugging Face's)."""
    r = run_ranks(_translate_functions, 1, timeout=120)[0]
    assert r == {"empty_before": True, "pairs": 1, "smp_names": True, "to_hf": True, "round_trip": True}


def test_fill_tied_adds_the_names_safetensors_leaves_out() -> None:
    from smp_compat.trainer.loading import fill_tied

    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight
    saved = {"0.weight": torch.randn(4, 3)}
    filled = fill_tied(model, dict(saved))
    assert set(filled) == {"0.weight", "1.weight"} and filled["1.weight"] is saved["0.weight"]


_PROBE = """
import json, sys
if sys.argv[1] == "import": import smp_compat
import transformers.training_args, transformers.trainer
from accelerate.optimizer import AcceleratedOptimizer
print(json.dumps({"fixed": [m.__dict__.get("_smp_compat_trainer_fixed", False) for m in
                            (transformers.training_args, transformers.trainer)],
                  "forwarding": "__getattr__" in AcceleratedOptimizer.__dict__}))
"""
_SMP_ENV = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 1, "microbatches": 1}),
            "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True}), "PYTHONPATH": SITE_DIR}  # fmt: skip


def _probes(*cases: tuple[str, bool]) -> list[dict]:
    """Fresh interpreters (transformers decides on SMP at import), run side by side."""
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE, how], env=clean_env(**(_SMP_ENV if smp_job else {})),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for how, smp_job in cases]  # fmt: skip
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.hf
def test_fixes_apply_in_smp_jobs_only() -> None:
    """In an SMP job (the environment transformers tests) ``import smp_compat`` installs the fixes; elsewhere
    transformers and accelerate are left exactly as they are."""
    assert _probes(("import", True), ("import", False)) == [
        {"fixed": [True, True], "forwarding": True},
        {"fixed": [False, False], "forwarding": False},
    ]


@pytest.mark.hf
@pytest.mark.slow
def test_sitecustomize_installs_the_fixes_before_the_script_imports_anything() -> None:
    """``smp-compat run``'s workers: transformers imports SMP halfway through ``training_args`` (which is then
    still loading), so the hook ``sitecustomize`` installed at start-up fixes the module once it has loaded."""
    assert _probes(("sitecustomize", True)) == [{"fixed": [True, True], "forwarding": True}]


def _forwarding() -> dict:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    import smp_compat as smp
    from smp_compat.trainer import fixes

    fixes._fix_accelerated_optimizer()
    Accelerator(cpu=True)
    smp.init({})
    plain = AcceleratedOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), device_placement=False)
    model = smp.DistributedModel(nn.Linear(2, 2))
    wrapped = AcceleratedOptimizer(smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
                                   device_placement=False)  # fmt: skip
    return {"plain": hasattr(plain, "local_state_dict"), "smp": callable(wrapped.local_state_dict),
            "own_members_kept": type(wrapped).step is AcceleratedOptimizer.step}  # fmt: skip


@pytest.mark.hf
def test_accelerated_optimizer_forwards_smp_members_of_smp_optimizers_only() -> None:
    r = run_ranks(_forwarding, 1, timeout=120)[0]
    assert r == {"plain": False, "smp": True, "own_members_kept": True}
