"""Issue 28's done-when: an AWS-shaped GPT-2 script runs as a SageMaker job here, and resumes its own checkpoint.

Nothing is exported by hand (the script reads SM_NUM_GPUS, SM_OUTPUT_DATA_DIR, SM_MODEL_DIR,
SM_CHANNEL_TRAIN and SM_CHANNEL_TEST at argparse time) and no trust flag is given (its user_content
holds a GPT2Config and numpy integers). Two 2-process jobs: the uninterrupted run from an estimator JSON,
which saves mid-way, and the same job from command-line options resuming that checkpoint in a fresh
container (empty home, no checkpoint key: issue 33). The resumed losses equal the uninterrupted run's, bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import launching
from launching import ROOT, clean_env, free_port, fresh_container_env, run_all, smp_compat_command

SCRIPT = ROOT / "tests" / "fixtures" / "smp_scripts" / "gpt2_sagemaker_job.py"
STEPS, SAVE_AT = 4, 2
HYPERPARAMETERS = {"max_steps": STEPS, "save_steps": SAVE_AT, "lr": 0.003, "use_distributed_transformer": 0,
                   "checkpoint-dir": "/opt/ml/checkpoints", "model_options": {"b": 2, "a": "x"}}  # fmt: skip


def _channels(tmp_path: Path) -> tuple[Path, Path]:
    """Synthetic token batches with a learnable pattern (every odd token repeats the one before it)."""
    train, test = tmp_path / "data" / "train", tmp_path / "data" / "test"
    train.mkdir(parents=True)
    test.mkdir(parents=True)
    ids = torch.randint(0, 64, (STEPS, 4, 16), generator=torch.Generator().manual_seed(0))
    ids[..., 1::2] = ids[..., 0::2]
    torch.save(ids, train / "train.pt")
    torch.save(ids[0], test / "test.pt")
    return train, test


def _run(tmp_path: Path, *options: str) -> None:
    """A restarted job: a fresh container with no key, so the first run's digests verify nothing."""
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()), *options]
    run_all([(cmd, fresh_container_env(tmp_path / "fresh-home"))], tmp_path)


def _output(job_dir: Path) -> dict[str, Any]:
    return json.loads((job_dir / "output" / "data" / "losses.json").read_text())


@pytest.mark.slow  # 12-18 s: CI's slow step runs it (the default run stays under 10 minutes)
def test_aws_shaped_script_runs_from_an_estimator_and_resumes_from_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launching, "TIMEOUT_S", 150)
    train, test = _channels(tmp_path)
    estimator = {
        "entry_point": SCRIPT.name, "source_dir": str(SCRIPT.parent), "role": "arn:aws:iam::0:role/SageMaker",
        "instance_type": "ml.p4d.24xlarge", "instance_count": 1, "framework_version": "1.13.1", "py_version": "py39",
        "hyperparameters": HYPERPARAMETERS, "checkpoint_s3_uri": "s3://bucket/checkpoints",
        "inputs": {"train": str(train), "test": "s3://bucket/test"},
        "distribution": {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"ddp": True}}},
                         "mpi": {"enabled": True, "processes_per_host": 2}},
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(estimator))
    first = tmp_path / "first"
    cmd = [*smp_compat_command(), "run", "--master-port", str(free_port()), "--job-dir", str(first),
           "--channel", f"test={test}", "--estimator", str(tmp_path / "job.json")]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    log = (tmp_path / "proc0.log").read_text()
    assert "arguments ignored: checkpoint_s3_uri, framework_version, py_version, role" in log
    full = _output(first)
    losses = {int(k): v for k, v in full["losses"].items()}
    assert sorted(losses) == list(range(STEPS))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert full["seen"] == {"num_gpus": gpus, "test_rows": 4, "model_options": "a=x,b=2", "use_distributed_transformer": 0,
                            "checkpoint_dir": str(first / "checkpoints")}  # fmt: skip
    assert (first / "checkpoints" / "newest").read_text().split() == [f"total_steps{SAVE_AT}_partial"]
    assert (first / "model" / "fullmodel.pt").is_file()

    resumed = tmp_path / "resumed"  # the same job from options, resuming the first run's checkpoint: no trust flag
    hps = json.dumps({**HYPERPARAMETERS, "load_partial": 1})
    _run(tmp_path, "--job-dir", str(resumed), "--checkpoint-dir", str(first / "checkpoints"),
         "--channel", f"train={train}", "--channel", f"test={test}", "--hyperparameters", hps, str(SCRIPT))  # fmt: skip
    assert {int(k): v for k, v in _output(resumed)["losses"].items()} == {s: losses[s] for s in range(SAVE_AT, STEPS)}
