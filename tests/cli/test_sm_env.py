"""SageMaker's training environment under `smp-compat run` / `env`: SM_* variables, hyperparameters, channels, hosts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from smp_compat.cli.commands import main
from smp_compat.cli.hyperparameters import env_value, to_cmd_args
from smp_compat.cli.run import plan_launch
from smp_compat.cli.sm_env import JOB_DIR_ENV, LOCAL_HOSTS_ENV
from smp_compat.launch import detect_launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "smp_dp_pp_tp.py"


@pytest.fixture
def data(tmp_path: Path) -> dict[str, Path]:
    """Two channel folders and a script, all under tmp_path."""
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    return {"train": tmp_path / "train", "test": tmp_path / "test", "script": script, "root": tmp_path}


def _plan(data: dict[str, Path], *options: str, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return plan_launch(["--job-dir", str(data["root"] / "job"), *options, str(data["script"])], environ=environ or {})


# ---------------------------------------------------------------- hyperparameters, value type by value type


@pytest.mark.parametrize(
    ("value", "arg", "env"),
    [
        ("abc", "abc", "abc"),  # string: as it is
        ("a b", "a b", "a b"),  # one argument, spaces kept
        (5, "5", "5"),  # int
        (0.0001, "0.0001", "0.0001"),  # float: Python's str
        (1e-10, "1e-10", "1e-10"),
        (2.0, "2.0", "2.0"),
        (True, "True", "true"),  # bool: Python's str on the command line, JSON in the environment
        (False, "False", "false"),
        (None, "", ""),  # null: empty
        ([1, "a", True], "[1, 'a', True]", '[1,"a",true]'),  # list: Python's str
        ({"b": 2, "a": "x"}, "a=x,b=2", '{"a":"x","b":2}'),  # dict: k=v pairs, keys sorted
        ({"n": {"m": 1}}, "n={'m': 1}", '{"n":{"m":1}}'),  # nested dict: str of the inner one
    ],
)
def test_each_value_type_becomes_what_sagemaker_gives(value: object, arg: str, env: str) -> None:
    assert to_cmd_args({"name": value}) == ["--name", arg]
    assert env_value(value) == env


def test_arguments_are_sorted_and_one_letter_names_get_one_dash() -> None:
    assert to_cmd_args({"zeta": 1, "a": 2, "batch-size": 3}) == ["-a", "2", "--batch-size", "3", "--zeta", "1"]


def test_hyperparameters_reach_the_script_and_environment(data: dict[str, Path]) -> None:
    hps = {"epochs": 2, "lr": 0.001, "fp16": True, "sagemaker_program": "train.py",
           "checkpoint-dir": "/opt/ml/checkpoints"}  # fmt: skip
    plan = _plan(data, "--hyperparameters", json.dumps(hps))
    ckpt = str(data["root"] / "job" / "checkpoints")
    args = ["--checkpoint-dir", ckpt, "--epochs", "2", "--fp16", "True", "--lr", "0.001"]
    assert plan.command[-len(args) - 1:] == [str(data["script"]), *args]
    env = plan.env_updates
    assert json.loads(env["SM_USER_ARGS"]) == args
    assert json.loads(env["SM_HPS"]) == {"epochs": 2, "lr": 0.001, "fp16": True, "checkpoint-dir": ckpt}
    assert env["SM_HP_EPOCHS"] == "2" and env["SM_HP_FP16"] == "true" and env["SM_HP_CHECKPOINT-DIR"] == ckpt
    assert json.loads(env["SM_FRAMEWORK_PARAMS"])["sagemaker_program"] == "train.py"  # not a script argument
    assert "hyperparameter checkpoint-dir: /opt/ml/checkpoints -> " + ckpt in plan.notes


def test_hyperparameters_from_a_file_and_script_args_after_them(data: dict[str, Path]) -> None:
    file = data["root"] / "hps.json"
    file.write_text('{"epochs": 3}')
    plan = plan_launch(["--hyperparameters", str(file), str(data["script"]), "--epochs", "4"], environ={})
    assert plan.command[-5:] == [str(data["script"]), "--epochs", "3", "--epochs", "4"]  # the command line wins


# ---------------------------------------------------------------- folders, channels, kept variables


def test_folders_and_channels_default_under_one_job_dir(data: dict[str, Path]) -> None:
    env = _plan(data, "--channel", f"train={data['train']}", "--channel", f"test={data['test']}").env_updates
    job = data["root"] / "job"
    assert env["SM_MODEL_DIR"] == str(job / "model")
    assert env["SM_OUTPUT_DIR"] == str(job / "output")
    assert env["SM_OUTPUT_DATA_DIR"] == str(job / "output" / "data")
    assert env["SM_INPUT_CONFIG_DIR"] == str(job / "input" / "config")
    assert env["SM_CHANNEL_TRAIN"] == str(data["train"]) and env["SM_CHANNEL_TEST"] == str(data["test"])
    assert json.loads(env["SM_CHANNELS"]) == ["test", "train"]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert env["SM_NUM_GPUS"] == str(gpus) and int(env["SM_NUM_CPUS"]) >= 1
    assert env["SM_USER_ENTRY_POINT"] == "train.py" and env["SM_MODULE_NAME"] == "train"
    training = json.loads(env["SM_TRAINING_ENV"])
    assert training["channel_input_dirs"] == {"train": str(data["train"]), "test": str(data["test"])}
    assert training["model_dir"] == env["SM_MODEL_DIR"] and training["hosts"] == ["algo-1"]


def test_the_job_folder_from_the_environment(data: dict[str, Path]) -> None:
    plan = plan_launch([str(data["script"])], environ={JOB_DIR_ENV: str(data["root"] / "jobs")})
    assert plan.env_updates["SM_MODEL_DIR"] == str(data["root"] / "jobs" / "model")


def test_options_set_the_folders(data: dict[str, Path]) -> None:
    model, out = data["root"] / "m", data["root"] / "o"
    env = _plan(data, "--model-dir", str(model), "--output-dir", str(out)).env_updates
    assert env["SM_MODEL_DIR"] == str(model) and env["SM_OUTPUT_DATA_DIR"] == str(out / "data")


def test_an_exported_variable_keeps_its_value_unless_an_option_sets_it(data: dict[str, Path]) -> None:
    """A job script that exports SM_MODEL_DIR (or SM_NUM_GPUS) before `smp-compat run` keeps its own value."""
    exported = {"SM_MODEL_DIR": "/mine/model", "SM_NUM_GPUS": "8"}
    plan = _plan(data, environ=exported)
    assert "SM_MODEL_DIR" not in plan.env_updates and "SM_NUM_GPUS" not in plan.env_updates
    training = json.loads(plan.env_updates["SM_TRAINING_ENV"])
    assert training["model_dir"] == "/mine/model" and training["num_gpus"] == 8  # derived values agree
    plan = _plan(data, "--model-dir", str(data["root"] / "m"), environ=exported)
    assert plan.env_updates["SM_MODEL_DIR"] == str(data["root"] / "m")  # the explicit option wins


def test_job_folders_are_created_at_launch_only(data: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    job = data["root"] / "job"
    assert main(["run", "--dry-run", "--job-dir", str(job), str(data["script"])]) == 0
    out = capsys.readouterr().out
    assert "SM_MODEL_DIR=" + str(job / "model") in out and "script arguments from hyperparameters" in out
    assert not job.exists()


# ---------------------------------------------------------------- hosts


@pytest.mark.parametrize(
    ("options", "environ", "hosts", "current"),
    [
        ([], {}, ["algo-1"], "algo-1"),
        (["--nnodes", "3", "--node-rank", "2"], {}, ["algo-1", "algo-2", "algo-3"], "algo-3"),
        (["--nnodes=2", "--node_rank=1"], {}, ["algo-1", "algo-2"], "algo-2"),
        ([], {"PET_NNODES": "2", "PET_NODE_RANK": "1"}, ["algo-1", "algo-2"], "algo-2"),
        ([], {"SLURM_NNODES": "4", "SLURM_NODEID": "3"}, ["algo-1", "algo-2", "algo-3", "algo-4"], "algo-4"),
        (["--nnodes", "2"], {"SLURM_NNODES": "2", "SLURM_NODEID": "1"}, ["algo-1", "algo-2"], "algo-2"),
        ([], {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
         ["algo-1", "algo-2"], "algo-2"),
    ],
)  # fmt: skip
def test_hosts_follow_the_launchers_node_rank(
    data: dict[str, Path], options: list[str], environ: dict[str, str], hosts: list[str], current: str
) -> None:
    env = _plan(data, *options, environ=environ).env_updates
    assert json.loads(env["SM_HOSTS"]) == hosts and env["SM_CURRENT_HOST"] == current
    assert json.loads(env["SM_RESOURCE_CONFIG"])["current_host"] == current


def test_made_up_host_names_are_not_used_as_the_rendezvous_address(data: dict[str, Path]) -> None:
    env = _plan(data, "--nnodes", "2", "--node-rank", "0").env_updates
    mpi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "MASTER_ADDR": "10.0.0.1"}  # fmt: skip
    assert env[LOCAL_HOSTS_ENV] == "1"
    launch = detect_launch({**mpi, "SM_HOSTS": env["SM_HOSTS"], LOCAL_HOSTS_ENV: "1"})
    assert launch.master_addr == "10.0.0.1"


def test_env_command_exports_the_training_environment(
    data: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    job = data["root"] / "job"
    argv = ["env", "--job-dir", str(job), "--channel", f"train={data['train']}", "--hyperparameters", '{"lr": 0.1}']
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"export SM_CHANNEL_TRAIN={data['train']}" in out and "export SM_CURRENT_HOST=algo-2" in out
    assert "# the hyperparameters as script arguments (append them to the command): --lr 0.1" in out
    assert json.loads((job / "input" / "config" / "hyperparameters.json").read_text()) == {"lr": "0.1"}
    assert (job / "model").is_dir() and (job / "output" / "data").is_dir() and (job / "checkpoints").is_dir()


# ---------------------------------------------------------------- bad input: one error, exit status 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--hyperparameters", "{epochs: 2}"], "--hyperparameters is not valid JSON"),
        (["--hyperparameters", "[1, 2]"], "must be a JSON object"),
        (["--hyperparameters", "no_such_file.json"], "neither a JSON object"),
        (["--channel", "train"], "must be NAME=DIR"),
        (["--channel", "train=/no/such/dir"], "does not exist"),
        (["--channel", "bad name=/tmp"], "not one SageMaker accepts"),
        (["--channel", "train=s3://bucket/train"], "names an S3 location"),
    ],
)
def test_bad_input_is_one_error_and_exit_status_2(
    data: dict[str, Path], capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    assert main(["run", "--job-dir", str(data["root"] / "job"), *options, str(data["script"])]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1
    assert not (data["root"] / "job").exists()
