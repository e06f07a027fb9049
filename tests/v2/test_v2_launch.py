"""`smp-compat run` takes SMP v2's distribution (--config, --estimator) and launches torchrun-style with the
SageMaker environment; --dry-run shows v2's layout; an unmodified v2 script's first lines run under it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launching import clean_env, free_port, run_all, smp_compat_command
from smp_compat.cli import main
from smp_compat.cli.launch_v2 import V2Launch
from smp_compat.cli.run import plan_launch
from smp_compat.errors import SMPConfigError

SCRIPT = Path(__file__).parent / "scripts" / "probe_launch.py"


def _distribution(**parameters: object) -> dict:
    return {"torch_distributed": {"enabled": True},
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": parameters}}}  # fmt: skip


def test_v2_distribution_is_planned_as_smp_v2(tmp_path: Path) -> None:
    config = json.dumps(_distribution(tensor_parallel_degree=2, hybrid_shard_degree=2))
    plan = plan_launch(["--nproc-per-node", "4", "--job-dir", str(tmp_path), "--config", config, str(SCRIPT)], {})
    assert isinstance(plan.smp, V2Launch)
    assert json.loads(plan.env_updates["SM_HP_MP_PARAMETERS"]) == {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
    assert json.loads(plan.env_updates["SM_FRAMEWORK_PARAMS"]) == {"sagemaker_torch_distributed_enabled": True}
    assert plan.env_updates["PYTHONPATH"].split(":")[0].endswith("shim/site")  # where the sitecustomize is
    assert plan.smp.world_size_problem(4, 1, 4) is None
    assert "must divide" in plan.smp.world_size_problem(6, 1, 6)


def test_bare_v2_parameters_are_v2_and_a_misspelt_key_names_the_nearest(tmp_path: Path) -> None:
    plan = plan_launch(["--job-dir", str(tmp_path), "--config", '{"hybrid_shard_degree": 2}', str(SCRIPT)], {})
    assert isinstance(plan.smp, V2Launch)
    with pytest.raises(SMPConfigError, match='did you mean "hybrid_shard_degree"'):
        plan_launch(["--config", json.dumps(_distribution(hybrid_shard_degre=2)), str(SCRIPT)], {})
    plan = plan_launch(["--config", json.dumps(_distribution(expert_parallel_degree=2, hybrid_shard_degree=2)),
                        str(SCRIPT)], {})  # fmt: skip
    assert isinstance(plan.smp, V2Launch) and plan.smp.config.expert_parallel_degree == 2
    with pytest.raises(SMPConfigError, match="cannot be combined with tensor_parallel_degree"):
        plan_launch(["--config", json.dumps(_distribution(expert_parallel_degree=2, tensor_parallel_degree=2,
                                                          hybrid_shard_degree=2)), str(SCRIPT)], {})  # fmt: skip


def test_estimator_with_v2_distribution_and_framework_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("")
    estimator = {"entry_point": "train.py", "framework_version": "2.4.1", "py_version": "py311",
                 "instance_type": "ml.p4d.24xlarge", "instance_count": 1,
                 "distribution": _distribution(tensor_parallel_degree=2, hybrid_shard_degree=4)}  # fmt: skip
    path = tmp_path / "job.json"
    path.write_text(json.dumps(estimator))
    assert main(["run", "--dry-run", "--job-dir", str(tmp_path / "job"), "--estimator", str(path)]) == 0
    out = capsys.readouterr().out
    assert "SMP v2 (torch.sagemaker). World size 8 = 1 node(s) x 8 process(es)" in out
    assert "Mesh (rep, shard, cp, tp) = (1, 4, 1, 2)" in out
    assert "shard      [0, 2, 4, 6] [1, 3, 5, 7]" in out
    assert "tp         [0, 1] [2, 3] [4, 5] [6, 7]" in out


def test_dry_run_at_hybrid_shard_1_and_native_fsdp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for params, expected in (({"hybrid_shard_degree": 1}, "replicas   [0, 1, 2, 3]"),
                             ({"sm_activation_offloading": False}, "native FSDP")):  # fmt: skip
        argv = ["run", "--dry-run", "--nproc-per-node", "4", "--job-dir", str(tmp_path), "--config",
                json.dumps(_distribution(**params)), str(SCRIPT)]  # fmt: skip
        assert main(argv) == 0
        assert expected in capsys.readouterr().out


def test_env_exports_the_v2_parameters_and_torchrun_framework_params(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config = json.dumps(_distribution(hybrid_shard_degree=2))
    assert main(["env", "--job-dir", str(tmp_path), "--config", config]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "export SM_HP_MP_PARAMETERS='{\"hybrid_shard_degree\": 2}'" in lines
    assert "export SM_FRAMEWORK_PARAMS='{\"sagemaker_torch_distributed_enabled\": true}'" in lines
    assert any(line.startswith("export PYTHONPATH=") and "shim/site" in line for line in lines)


def test_unmodified_v2_script_lines_run_under_smp_compat_run(tmp_path: Path) -> None:
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--job-dir", str(tmp_path / "job"), "--config", json.dumps(_distribution(tensor_parallel_degree=2)),
           str(SCRIPT), "--out", str(tmp_path), "--distributed_backend", "nccl"]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["backend"] == "gloo"  # nccl on a CPU-only torch, announced once
        assert (report["rank"], report["tp_rank"], report["dp_rank"], report["tp_sum"]) == (rank, rank, 0, 2.0)
        assert report["mesh"] == [1, 1, 1, 2] and report["hsd"] == 0
        assert report["framework"] == {"sagemaker_torch_distributed_enabled": True}
        assert report["te"] == "smp_compat.v2.standins.transformer_engine"
    log = (tmp_path / "proc0.log").read_text()
    assert log.count('backend "nccl" needs CUDA') == 2  # once per process


def test_without_a_config_a_script_importing_torch_sagemaker_is_launched_as_v2(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """AWS's entry point imports train_lib, which imports torch.sagemaker: v2, found one module down."""
    (tmp_path / "train_external.py").write_text("import os\nfrom arguments import parse_args\nimport train_lib\n")
    (tmp_path / "arguments.py").write_text("import argparse\n")
    (tmp_path / "train_lib.py").write_text("import torch\nimport torch.sagemaker as tsm\n")
    (tmp_path / "direct.py").write_text("from torch.sagemaker.distributed.checkpoint.state_dict_utils import x\n")
    (tmp_path / "v1.py").write_text("import smdistributed.modelparallel.torch as smp\n")
    job = ["--nproc-per-node", "4", "--job-dir", str(tmp_path / "job")]
    for script in ("train_external.py", "direct.py"):
        plan = plan_launch([*job, str(tmp_path / script)], {})
        assert isinstance(plan.smp, V2Launch), script
        assert json.loads(plan.env_updates["SM_FRAMEWORK_PARAMS"]) == {"sagemaker_torch_distributed_enabled": True}
        assert "SM_HP_MP_PARAMETERS" not in plan.env_updates
    assert "train_lib.py:2): launching it as SMP v2" in plan_launch([*job, str(tmp_path / "train_external.py")], {}).launch.notes[0]
    v1 = plan_launch([*job, str(tmp_path / "v1.py")], {})
    assert not isinstance(v1.smp, V2Launch) and json.loads(v1.env_updates["SM_FRAMEWORK_PARAMS"]) == {"sagemaker_mpi_enabled": True}
    # a config, when given, still decides
    assert not isinstance(plan_launch([*job, "--config", '{"microbatches": 2}', str(tmp_path / "direct.py")], {}).smp, V2Launch)
    assert main(["run", "--dry-run", *job, str(tmp_path / "train_external.py")]) == 0
    out = capsys.readouterr().out
    assert "SMP v2 (torch.sagemaker). World size 4" in out and "the script's tsm.init(...) dict decides" in out
