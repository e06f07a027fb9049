"""`smp-compat run --estimator job.json`: a sagemaker.pytorch.PyTorch estimator's arguments run here."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from smp_compat.cli.commands import main
from smp_compat.cli.run import plan_launch

DISTRIBUTION = {
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 1, "ddp": True}}},
    "mpi": {"enabled": True, "processes_per_host": 2},
}


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A source_dir with an entry point, a data folder, and where the estimator JSON goes."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    (tmp_path / "data").mkdir()
    return tmp_path


def _write(job: Path, **kwargs: Any) -> str:
    estimator = {"entry_point": "train.py", "source_dir": "code", **kwargs}
    path = job / "job.json"
    path.write_text(json.dumps(estimator))
    return str(path)


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_estimator_defines_script_processes_nodes_and_hyperparameters(job: Path) -> None:
    path = _write(job, hyperparameters={"epochs": 2, "fp16": True}, distribution=DISTRIBUTION, instance_count=1,
                  instance_type="ml.p4d.24xlarge", inputs={"train": "data"}, environment={"MY_VAR": "1", "KEPT": "x"},
                  container_log_level=10, dependencies=["data"])  # fmt: skip
    plan = plan_launch(["--job-dir", str(job / "out"), "--estimator", path], environ={"KEPT": "mine"})
    script = str(job / "code" / "train.py")
    assert plan.command[-5:] == [script, "--epochs", "2", "--fp16", "True"]
    assert _option(plan.command, "--nproc-per-node") == "2"  # mpi.processes_per_host before the instance's 8 GPUs
    assert _option(plan.command, "--nnodes") == "1"
    assert json.loads(plan.env_updates["SM_HP_MP_PARAMETERS"])["ddp"] is True
    assert plan.env_updates["SM_CHANNEL_TRAIN"] == str(job / "data")
    assert plan.env_updates["SM_MODULE_DIR"] == str(job / "code") and plan.cwd == str(job / "code")
    assert plan.env_updates["SM_CURRENT_INSTANCE_TYPE"] == "ml.p4d.24xlarge"
    assert plan.env_updates["MY_VAR"] == "1" and plan.env_updates["SM_LOG_LEVEL"] == "10"
    assert "KEPT" not in plan.env_updates  # a variable already exported wins over the estimator's
    assert plan.env_updates["PYTHONPATH"].split(os.pathsep)[0] == str(job / "data")  # dependencies first
    assert plan.notes == ()


def test_processes_per_host_from_the_instance_type_and_nodes_from_instance_count(job: Path) -> None:
    path = _write(job, instance_type="ml.g5.12xlarge", instance_count=2)
    plan = plan_launch(["--estimator", path, "--node-rank", "1"], environ={})
    assert _option(plan.command, "--nproc-per-node") == "4" and _option(plan.command, "--nnodes") == "2"
    assert plan.env_updates["SM_CURRENT_HOST"] == "algo-2"
    plan = plan_launch(["--nproc-per-node", "1", "--estimator", path], environ={})  # the command line wins
    assert _option(plan.command, "--nproc-per-node") == "1"


def test_an_unknown_instance_type_is_said(job: Path) -> None:
    plan = plan_launch(["--estimator", _write(job, instance_type="ml.c5.xlarge")], environ={})
    assert any("'ml.c5.xlarge' is not in smp-compat's table" in n for n in plan.notes)


def test_sagemaker_only_arguments_are_listed_in_one_warning(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(job, role="arn:aws:iam::1:role/x", output_path="s3://b/out", checkpoint_s3_uri="s3://b/ckpt",
                  framework_version="1.13", entry_pont="typo.py")  # fmt: skip
    assert main(["run", "--dry-run", "--job-dir", str(job / "out"), "--estimator", path]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert len(warnings) == 1
    assert "checkpoint_s3_uri, framework_version, output_path, role (meaningful on SageMaker only)" in warnings[0]
    assert "entry_pont (not an estimator argument smp-compat knows)" in warnings[0]


def test_s3_input_needs_a_local_channel(job: Path) -> None:
    path = _write(job, inputs={"train": "s3://bucket/train", "test": "file://data"})
    with pytest.raises(Exception, match="Channel 'train' .* reads s3://bucket/train.*--channel train=DIR"):
        plan_launch(["--estimator", path], environ={})
    plan = plan_launch(["--channel", f"train={job / 'data'}", "--estimator", path], environ={})
    assert json.loads(plan.env_updates["SM_CHANNELS"]) == ["test", "train"]


def test_checkpoint_local_path_is_the_checkpoint_folder(job: Path) -> None:
    path = _write(job, checkpoint_local_path=str(job / "ck"), hyperparameters={"ckpt": str(job / "ck")})
    plan = plan_launch(["--estimator", path], environ={})
    assert plan.job is not None and plan.job.checkpoint_dir == job / "ck"


@pytest.mark.parametrize(
    ("estimator", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('["train.py"]', "must hold one JSON object"),
        ('{"source_dir": "code"}', 'has no "entry_point"'),
        ('{"entry_point": "missing.py", "source_dir": "code"}', "entry_point 'missing.py' not found under source_dir"),
        ('{"entry_point": "train.py", "source_dir": "s3://b/src.tar.gz"}', "is not a local directory"),
        ('{"entry_point": "train.py", "source_dir": "code", "instance_count": 0}', '"instance_count" must be'),
        ('{"entry_point": "train.py", "source_dir": "code", "hyperparameters": [1]}', "must be a JSON object"),
        ('{"entry_point": "train.py", "source_dir": "code", "inputs": {"a b": "data"}}', "not one SageMaker accepts"),
    ],
)
def test_bad_estimator_is_one_error_and_exit_status_2(
    job: Path, capsys: pytest.CaptureFixture[str], estimator: str, message: str
) -> None:
    path = job / "job.json"
    path.write_text(estimator)
    assert main(["run", "--job-dir", str(job / "out"), "--estimator", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1
    assert not (job / "out").exists()


def test_estimator_and_a_script_or_config_together_are_refused(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(job, distribution=DISTRIBUTION)
    assert main(["run", "--estimator", path, str(job / "code" / "train.py")]) == 2
    assert "names the training script" in capsys.readouterr().err
    assert main(["run", "--config", '{"partitions": 1}', "--estimator", path]) == 2
    assert "give it once" in capsys.readouterr().err
