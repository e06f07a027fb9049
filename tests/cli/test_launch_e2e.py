"""End to end: examples/train_dp.py trains like plain PyTorch under every launcher; dry-run layouts; the shim."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import smp_compat
from smp_compat import cli, shim
from smp_compat.cli.launch_config import SMP_V1, SMP_V2, smp_major
from smp_compat.cli.run import plan_launch
from smp_compat.errors import SMPConfigError
from launching import TIMEOUT_S, clean_env, free_port, run_all, smp_compat_command

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_dp.py"
DP2_CONFIG = ROOT / "examples" / "configs" / "dp2.json"
STEPS, GLOBAL_BATCH, LR = 4, 16, 0.2
PARAMETERS = {"microbatches": 2, "ddp": True}
DISTRIBUTION = {
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": PARAMETERS}},
    "mpi": {"enabled": True, "processes_per_host": 2},
}


# ---------------------------------------------------------------- helpers


def _load_example() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("train_dp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process PyTorch on the global batch, with the example's own model and data."""
    example = _load_example()
    model = example.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in example.make_batches(STEPS, GLOBAL_BATCH):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _example_args(out: Path, *extra: str) -> list[str]:
    return [str(EXAMPLE), "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH), "--lr", str(LR),
            "--out", str(out), *extra]  # fmt: skip


def _check_result(out: Path, reference: tuple[list[float], dict[str, torch.Tensor]]) -> dict[str, Any]:
    result = torch.load(out)
    ref_losses, ref_params = reference
    assert (result["world_size"], result["dp_size"]) == (2, 2)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert result["params"].keys() == ref_params.keys()
    for name, value in ref_params.items():
        try:
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
        except AssertionError as exc:
            raise AssertionError(f"parameter {name}: {exc}") from None
    return result


# ---------------------------------------------------------------- (a)-(d): launchers


def test_smp_compat_run_unmodified_script_matches_plain_pytorch(tmp_path: Path, reference: Any) -> None:
    out = tmp_path / "result.pt"
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--config", json.dumps(DISTRIBUTION), *_example_args(out)]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    result = _check_result(out, reference)
    assert result["smp_import"] == "smdistributed.modelparallel.torch"  # the shim, not the fallback
    assert result["config"]["microbatches"] == 2 and result["config"]["ddp"] is True
    assert result["initialized_on_import"] is False  # torchrun sets no OMPI variable: no auto-init


def test_torchrun_with_env_config_overriding_script_dict(tmp_path: Path, reference: Any) -> None:
    out = tmp_path / "result.pt"
    env = clean_env(SM_HP_MP_PARAMETERS=json.dumps({"microbatches": 4, "ddp": True}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), *_example_args(out, "--script-config")]  # fmt: skip
    run_all([(cmd, env)], tmp_path)
    result = _check_result(out, reference)
    assert result["smp_import"] == "smp_compat"
    assert result["config"]["microbatches"] == 4  # SM_HP_MP_PARAMETERS wins over smp.init's dict (2)


def test_mpi_variables_by_hand_with_shim(tmp_path: Path, reference: Any) -> None:
    out = tmp_path / "result.pt"
    base = clean_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        SM_HP_MP_PARAMETERS=json.dumps(PARAMETERS),
        PYTHONPATH=shim.pythonpath_with_shim(os.environ.get("PYTHONPATH")),
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    )
    commands = [
        ([sys.executable, *_example_args(out)],
         {**base, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)})
        for r in range(2)
    ]  # fmt: skip
    run_all(commands, tmp_path)
    result = _check_result(out, reference)
    assert result["smp_import"] == "smdistributed.modelparallel.torch"
    assert result["initialized_on_import"] is True  # SMP's rule: config + OMPI rank set -> init on import


def test_slurm_variables_by_hand(tmp_path: Path, reference: Any) -> None:
    out = tmp_path / "result.pt"
    base = clean_env(
        MASTER_PORT=str(free_port()),
        SM_HP_MP_PARAMETERS=json.dumps(PARAMETERS),
        SLURM_NTASKS="2",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_ID="0",
        SLURM_STEP_NODELIST="localhost",
        SLURM_STEP_TASKS_PER_NODE="2",
    )
    commands = [
        ([sys.executable, *_example_args(out)], {**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
        for r in range(2)
    ]
    run_all(commands, tmp_path)
    result = _check_result(out, reference)
    assert result["smp_import"] == "smp_compat"
    assert result["initialized_on_import"] is False


# ---------------------------------------------------------------- (e): dry run and the launch plan


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["run", "--dry-run", *args, str(EXAMPLE)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rank_rows(out: str) -> dict[int, tuple[int, ...]]:
    """rank -> (pp_rank, tp_rank, rdp_rank, dp_rank, mp_rank), read from the printed table."""
    rows = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 6 and all(f.isdigit() for f in fields):
            rows[int(fields[0])] = tuple(int(f) for f in fields[1:])
    return rows


def _group_line(out: str, axis: str) -> str:
    return next(" ".join(line.split()[1:]) for line in out.splitlines() if line.split()[:1] == [axis])


@pytest.mark.parametrize(
    ("placement", "pp_dp", "mp_groups", "dp_groups"),
    [
        ("cluster", lambda r: (r % 2, r // 2), "[0, 1] [2, 3] [4, 5] [6, 7]", "[0, 2, 4, 6] [1, 3, 5, 7]"),
        ("spread", lambda r: (r // 4, r % 4), "[0, 4] [1, 5] [2, 6] [3, 7]", "[0, 1, 2, 3] [4, 5, 6, 7]"),
    ],
    ids=["cluster", "spread"],
)
def test_dry_run_matches_reference_table_a(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, placement: str, pp_dp: Any,
    mp_groups: str, dp_groups: str,
) -> None:  # fmt: skip
    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    config = {"pipeline_parallel_degree": 2, "ddp": True, "placement_strategy": placement}
    code, out, err = _dry_run(capsys, "--nproc-per-node", "8", "--config", json.dumps(config))
    assert code == 0, err
    rows = _rank_rows(out)
    assert sorted(rows) == list(range(8))
    for rank, (pp, tp, rdp, dp, mp) in rows.items():
        assert (pp, dp) == pp_dp(rank), f"rank {rank}"
        assert (tp, rdp, mp) == (0, dp, pp)
    assert _group_line(out, "mp") == mp_groups
    assert _group_line(out, "dp") == dp_groups
    assert "World size 8 = 1 node(s) x 8 process(es)" in out
    assert "torch.distributed.run --nproc-per-node 8 " in out


def test_dry_run_rejects_world_size_the_config_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry_run(capsys, "--nproc-per-node", "8", "--config", '{"pipeline_parallel_degree": 3}')
    assert code == 2
    assert "must divide the world size (8)" in err


def test_invalid_config_is_an_error_before_launch(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry_run(capsys, "--config", '{"microbatch": 2}')
    assert code == 2
    assert 'unknown key "microbatch"' in err and "did you mean" in err
    code, _, err = _dry_run(capsys, "--config", "no/such/file.json")
    assert code == 2 and "neither a JSON object" in err


V2_DISTRIBUTION = {"torch_distributed": {"enabled": True},
                   "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"hybrid_shard_degree": 2}}}}


@pytest.mark.parametrize(("raw", "major"), [
    (DISTRIBUTION, SMP_V1), (PARAMETERS, SMP_V1), (DISTRIBUTION["smdistributed"], SMP_V1),
    ({"torch_distributed": {"enabled": True}, "pipeline_parallel_degree": 2}, SMP_V1),  # no SMP section
    (V2_DISTRIBUTION, SMP_V2), ({"hybrid_shard_degree": 2}, SMP_V2),  # bare parameters with a v2-only key
])  # fmt: skip
def test_the_smp_major_version_is_sagemakers_rule(raw: dict[str, Any], major: int) -> None:
    assert smp_major(raw) == major


def test_an_smp_v2_distribution_is_launched_as_v2_not_checked_as_v1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _dry_run(capsys, "--nproc-per-node", "2", "--config", json.dumps(V2_DISTRIBUTION))
    assert code == 0, err
    assert "SMP v2 (torch.sagemaker)" in out and "unknown key" not in err  # v2's layout: tests/v2/test_v2_launch.py


def test_plan_uses_processes_per_host_and_exports_sagemaker_variables() -> None:
    plan = plan_launch(["--config", str(DP2_CONFIG), str(EXAMPLE), "--config", "for-the-script"], environ={})
    run = plan.command.index("torch.distributed.run")
    assert plan.command[run + 1 :] == ["--nproc-per-node", "2", str(EXAMPLE), "--config", "for-the-script"]
    assert plan.world_size == 2
    params = json.loads(plan.env_updates["SM_HP_MP_PARAMETERS"])
    assert params == {"pipeline_parallel_degree": 1, "microbatches": 2, "ddp": True, "partitions": 1}
    assert json.loads(plan.env_updates["SM_FRAMEWORK_PARAMS"]) == {"sagemaker_mpi_enabled": True}
    assert plan.env_updates["PYTHONPATH"].split(os.pathsep)[0] == shim.SITE_DIR


def test_plan_keeps_explicit_torchrun_options() -> None:
    argv = ["--nnodes", "1", "--nproc_per_node=1", "--dry-run", "--config", str(DP2_CONFIG), str(EXAMPLE)]
    plan = plan_launch(argv, environ={"PYTHONPATH": "/elsewhere"})
    run = plan.command.index("torch.distributed.run")
    assert plan.command[run + 1 :] == ["--nnodes", "1", "--nproc_per_node=1", str(EXAMPLE)]
    assert plan.dry_run and plan.world_size == 1
    assert plan.env_updates["PYTHONPATH"] == os.pathsep.join([shim.SITE_DIR, "/elsewhere"])


def test_plan_without_config_leaves_the_script_in_charge() -> None:
    plan = plan_launch([str(EXAMPLE)], environ={})
    assert "SM_HP_MP_PARAMETERS" not in plan.env_updates
    assert plan.launch.parameters is None
    inherited = plan_launch([str(EXAMPLE)], environ={"SM_HP_MP_PARAMETERS": '{"partitions": 1}'})
    assert json.loads(inherited.env_updates["SM_HP_MP_PARAMETERS"]) == {"partitions": 1}


def test_plan_rejects_a_missing_script() -> None:
    with pytest.raises(SMPConfigError, match="does not exist"):
        plan_launch(["--config", str(DP2_CONFIG), "no_such_script.py"], environ={})


def test_env_command_prints_exports(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    assert cli.main(["env", "--config", str(DP2_CONFIG)]) == 0
    exports = dict(shlex.split(line)[1].split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert json.loads(exports["SM_HP_MP_PARAMETERS"])["partitions"] == 1
    assert exports["PYTHONPATH"].startswith(shim.SITE_DIR)


def test_launch_notes_are_printed_by_run_and_env(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A SageMaker config's mpi options that torchrun does not use are noted, not fatal (regression: the
    loop variable shadowed the printing function)."""
    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    config = json.dumps({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"ddp": True}}},
                         "mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": "-verbose"}})
    code, out, err = _dry_run(capsys, "--config", config)
    assert code == 0, err
    assert "custom_mpi_options" in out + err
    assert cli.main(["env", "--config", config]) == 0
    assert "custom_mpi_options" in "".join(capsys.readouterr())


def test_unknown_command_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "run" in err and "env" in err


# ---------------------------------------------------------------- (f): the shim


@pytest.fixture
def installed_shim() -> Any:
    shim.install()
    yield
    shim.uninstall()


@pytest.mark.usefixtures("installed_shim")
def test_shim_maps_package_and_submodules_to_the_same_objects() -> None:
    smp = importlib.import_module("smdistributed.modelparallel.torch")
    assert smp is smp_compat
    for name in ("globalstate", "stepping", "stepping.output", "config", "topology", "comm", "model", "optimizer", "amp"):
        alias = importlib.import_module(f"smdistributed.modelparallel.torch.{name}")
        assert alias is importlib.import_module(f"smp_compat.{name}"), name
    importlib.import_module("smdistributed.modelparallel.torch.partitioning")
    # importing aliases must never replace the API objects that share a name with a submodule
    assert callable(smp_compat.step) and callable(smp_compat.partition) and hasattr(smp_compat.state, "cfg")
    spec = importlib.import_module("smp_compat.globalstate").__spec__
    assert spec is not None and spec.name == "smp_compat.globalstate"  # the real module's spec is untouched
    from smdistributed.modelparallel.torch.stepping.output import StepOutput  # type: ignore[import-not-found]

    assert StepOutput is smp_compat.StepOutput
    with pytest.raises(ModuleNotFoundError, match=re.escape("smdistributed.modelparallel.torch.no_such_module")):
        importlib.import_module("smdistributed.modelparallel.torch.no_such_module")
    assert importlib.import_module("smdistributed.modelparallel").__version__ == shim.SMP_API_VERSION
    shim.install()  # idempotent
    assert sum(type(f).__name__ == "AliasFinder" for f in sys.meta_path) == 1


def test_shim_refuses_when_real_smp_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "smdistributed.modelparallel.torch", types.ModuleType("real_smp"))
    with pytest.raises(shim.ShimConflictError, match="already imported") as info:
        shim.install()
    assert isinstance(info.value, ImportError)


def test_shim_is_absent_by_default_and_boots_from_pythonpath() -> None:
    probe = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('smdistributed')\n"
        "print('absent' if spec is None else spec.origin)\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import smdistributed.modelparallel.torch as smp, smp_compat\n"
        "import smdistributed.modelparallel.torch.stepping as step\n"
        "from smdistributed.modelparallel import __version__\n"
        "print(smp is smp_compat, step is smp_compat.stepping, smp_compat.__spec__.name, __version__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe, shim.SITE_DIR], env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()[-2:]
    assert first == "absent" or not first.startswith(shim.SITE_DIR)  # a real SMP install may exist
    assert second == f"True True smp_compat {shim.SMP_API_VERSION}"


def test_output_cut_short_by_the_reader_ends_quietly(tmp_path: Path) -> None:
    """`smp-compat checkpoint info ... | head`: the closed pipe raised BrokenPipeError with a traceback."""
    code = ("import sys\nfrom smp_compat.cli import commands\n"
            "commands.COMMANDS['checkpoint'] = commands.Command('x', lambda a: [print('line', i) for i in range(10**6)])\n"
            "sys.exit(commands.main(['checkpoint']))\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(), cwd=tmp_path)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"line")
    proc.stdout.close()  # the reader is done, like `head`
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
