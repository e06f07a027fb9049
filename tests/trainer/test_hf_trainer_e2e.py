"""Hugging Face's real ``Trainer`` (tests/fixtures/hf_trainer/trainer_job.py, no SMP import) through
``smp-compat run`` with HF's SageMaker distribution scaled down, against plain transformers in one process at
the same global batch: a tiny GPT-2 and a tiny BERT classifier, pp 2 and pp 2 x dp 2, train, evaluate, save
(both formats under transformers 4, safetensors only under 5), resume from the mid-run checkpoint (equal
to the uninterrupted run), and fp16 against the project's 16-bit oracle (tests/oracle16.py).
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401  (the test extra installs it, as transformers itself: these tests must run, not skip)
import pytest
import torch
import transformers

import launching
from launching import ROOT, clean_env, free_port, run_all, smp_compat_command

sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "hf_trainer"))
import trainer_job  # noqa: E402
from oracle16 import TOLERANCE, train_16bit  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

SCRIPT = ROOT / "tests" / "fixtures" / "hf_trainer" / "trainer_job.py"
STEPS, SAVE_AT, PER_DEVICE = 4, 2, 2
# Hugging Face's documented SMP parameters (partitions 4, microbatches 4 on 8 GPUs), scaled to 2 and 2
HF_PARAMETERS = {"microbatches": 2, "placement_strategy": "spread", "pipeline": "interleaved", "optimize": "speed",
                 "partitions": 2, "ddp": True}  # fmt: skip
WEIGHTS_ATOL = 2e-5  # 0.4% of one step at lr 5e-3: Adam turns rounding noise in ~0 gradients into <= 6e-6 moves
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# transformers 4.40's Trainer._load_rng_state calls torch.load(rng_state.pth) with torch >= 2.6's weights_only
# default, which refuses the numpy state in it: every resume fails there, plain or SMP (later releases allow it)
RESUMES = "safe_globals" in inspect.getsource(transformers.Trainer._load_rng_state)
# transformers 4.40's Trainer refuses fp16 whenever the device is the CPU ("Tried to use `fp16` but it is not
# supported on cpu"), SMP's fp16 included; left as transformers decides (docs/porting.md)
_INIT = inspect.getsource(transformers.Trainer.__init__)
FP16_ON_CPU = "not supported on cpu" not in _INIT or "is_torch_greater_or_equal_than_2_3" in _INIT  # 4.4x: torch >= 2.3


def _job(tmp_path: Path, name: str, procs: int, *args: str, fp16: bool = False) -> dict[str, Any]:
    """One ``smp-compat run`` of the fixture; rank 0's results."""
    out = tmp_path / name
    out.mkdir()
    config = {**HF_PARAMETERS, "fp16": True} if fp16 else HF_PARAMETERS
    distribution = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": config}},
                    "mpi": {"enabled": True, "processes_per_host": procs}}  # fmt: skip
    cmd = [*smp_compat_command(), "run", "--master-port", str(free_port()), "--config", json.dumps(distribution),
           str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *args]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    return torch.load(out / "rank0.pt")


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(folder / "model.safetensors")
    return torch.load(folder / "pytorch_model.bin")


def _losses(result: dict[str, Any]) -> list[float]:
    return [h["loss"] for h in result["log_history"] if "loss" in h][:STEPS]


def _same_training(kind: str, got: dict[str, Any], ref: dict[str, Any], got_dir: Path, ref_dir: Path) -> None:
    assert got["train_batch_size"] == ref["train_batch_size"]
    torch.testing.assert_close(torch.tensor(_losses(got)), torch.tensor(_losses(ref)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["eval"]["eval_loss"], ref["eval"]["eval_loss"], rtol=1e-5, atol=0)
    a, b = _weights(got_dir / "final"), _weights(ref_dir / "final")
    assert a.keys() == b.keys()
    initial = trainer_job.build_model(kind).state_dict()
    moved = max((b[k] - initial[k]).abs().max().item() for k in b)
    assert moved > 10 * WEIGHTS_ATOL  # the model trained: the comparison below could fail
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=WEIGHTS_ATOL, msg=lambda m, k=key: f"{k}: {m}")


CASES = [  # (model, processes, format): pp 2 and pp 2 x dp 2, each model in both save formats across the two
    ("gpt2", 2, "safetensors"),
    ("gpt2", 4, "bin"),
    ("bert", 4, "safetensors"),
    ("bert", 2, "bin"),
]


@pytest.mark.parametrize(("kind", "procs", "fmt"), CASES, ids=[f"{k}-pp2x{p // 2}-{f}" for k, p, f in CASES])
def test_trainer_matches_plain_transformers_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, procs: int, fmt: str
) -> None:
    monkeypatch.setattr(launching, "TIMEOUT_S", 300)
    bin_format = fmt == "bin" and not TRANSFORMERS_5  # transformers 5 writes safetensors only
    extra = ["--kind", kind, "--batch", str(PER_DEVICE), *(["--bin"] if bin_format else []),
             *(["--use_cpu"] if kind == "bert" else [])]  # fmt: skip
    got = _job(tmp_path, "smp", procs, "--save_steps", str(SAVE_AT), *extra)
    checkpoint = tmp_path / "smp" / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / ("pytorch_model.bin" if bin_format else "model.safetensors")).is_file()
    replicas = procs // 2
    ref = trainer_job.run(kind, str(tmp_path / "ref"), PER_DEVICE * replicas, STEPS, safetensors=not bin_format,
                          use_cpu=kind == "bert")  # fmt: skip
    assert got["train_batch_size"] == PER_DEVICE * replicas
    _same_training(kind, got, ref, tmp_path / "smp", tmp_path / "ref")

    if not RESUMES:
        return
    resumed = _job(tmp_path, "resumed", procs, "--resume", str(checkpoint), "--no_eval", *extra)
    torch.testing.assert_close(_losses(resumed), _losses(got), rtol=1e-6, atol=0)
    a, b = _weights(tmp_path / "resumed" / "final"), _weights(tmp_path / "smp" / "final")
    for key in b:  # the tied embedding's gradient sums its pipeline contributions in the order they arrive, so
        # two identical runs may differ in a last bit, which Adam turns into moves up to WEIGHTS_ATOL in ~0-gradient
        # entries (seen: 1.9e-9 in wte, 2.5e-7 in an attention key bias)
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=WEIGHTS_ATOL, msg=lambda m, k=key: f"{k}: {m}")


def test_trainer_fp16_matches_the_16bit_oracle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``"fp16": true`` with the Trainer's fp32-built GPT-2: trained as SMP's fp16 recipe prescribes (fp16 model,
    fp32 masters, clipping on the masters' global norm). SGD: Adam would turn 16-bit rounding noise in the ~0
    gradients (attention key biases) into whole-step moves, which no 16-bit tolerance can compare."""
    if not FP16_ON_CPU and not torch.cuda.is_available():
        pytest.skip(f"transformers {transformers.__version__} refuses fp16 on the CPU itself")
    monkeypatch.setattr(launching, "TIMEOUT_S", 300)
    got = _job(tmp_path, "fp16", 2, "--lr_scheduler", "constant", "--optim", "sgd", fp16=True)
    model = trainer_job.build_model("gpt2").half()
    oracle = train_16bit(model, got["batches"][:STEPS], lambda m, b: m(**b).loss.float(),
                         lambda params: torch.optim.SGD(params, lr=5e-3), torch.float16, clip=1.0)  # fmt: skip
    torch.testing.assert_close(torch.tensor(_losses(got)), torch.tensor(oracle.losses), rtol=1e-4, atol=1e-4)
    norms = [h["grad_norm"] for h in got["log_history"] if "grad_norm" in h][:STEPS]
    torch.testing.assert_close(torch.tensor(norms, dtype=torch.float32), torch.tensor(oracle.norms), rtol=1e-3, atol=0)
    saved = _weights(tmp_path / "fp16" / "final")
    rtol, atol = TOLERANCE[torch.float16]
    for name, weight in oracle.weights.items():
        assert saved[name].dtype == torch.float16
        torch.testing.assert_close(saved[name], weight, rtol=rtol, atol=atol, msg=lambda m, k=name: f"{k}: {m}")
