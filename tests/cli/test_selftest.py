"""``smp-compat selftest``: the whole battery passes at 2 and 4 ranks; injected faults FAIL the right check, naming
the rank where the run went wrong, and end the job in seconds, not at a timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask NVML: the forked ranks below must find CUDA unused
import torch  # noqa: E402

from launching import ROOT, clean_env, free_port, smp_compat_command
from smp_compat.checkpoints.signing import KEY_ENV
from smp_compat.selftest.checks import CHECKS
from smp_compat.selftest.faults import FAULT_ENV
from smp_compat.testing import RankFailure, run_ranks

TIMEOUT_S = 240
USER_CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}


def _selftest(tmp_path: Path, nproc: int, *args: str, **env: str) -> tuple[int, str, dict[str, Any], float]:
    """The command as users type it: (exit status, output, JSON report, seconds)."""
    report = tmp_path / "report.json"
    cmd = [*smp_compat_command(), "selftest", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           "--json", str(report), *args]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=clean_env(**env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"smp-compat selftest did not finish within {TIMEOUT_S} s:\n{output[-6000:]}")
    seconds = time.monotonic() - start
    assert report.exists(), output[-6000:]
    return proc.returncode, output, json.loads(report.read_text()), seconds


def _by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def test_two_ranks_pass_with_the_users_config(tmp_path: Path) -> None:
    code, output, report, _ = _selftest(tmp_path, 2, "--config", json.dumps(USER_CONFIG))
    assert code == 0, output[-6000:]
    checks = _by_name(report)
    assert list(checks) == [c.name for c in CHECKS] + ["user-config"]
    skipped = {name for name, c in checks.items() if c["status"] == "SKIP"}
    assert skipped == {"pp2-spread", "v2-tp2-hsd2"}, {n: c["reason"] for n, c in checks.items() if n in skipped}
    assert "neighbouring ranks" in checks["pp2-spread"]["reason"]
    assert "multiple of 4 ranks" in checks["v2-tp2-hsd2"]["reason"]
    assert all(c["status"] == "PASS" for n, c in checks.items() if n not in skipped), output[-6000:]
    assert checks["v2-hsd2"]["layout"] == "shard2×rep1" and checks["v2-sharded-resume"]["worst_difference"] < 1e-5
    assert checks["v2-cp2"]["layout"] == "cp2×shard1×rep1" and checks["v2-cp2"]["worst_difference"] < 1e-5
    assert checks["v2-ep2"]["layout"] == "ep2×shard2×rep1" and checks["v2-ep2"]["worst_difference"] < 1e-5
    assert checks["user-config"]["layout"] == "pp2" and checks["pp2-simple"]["worst_difference"] < 1e-5
    assert checks["pp2-simple"]["pipeline_links"] == {"0": "rank 1: shared memory", "1": "rank 0: shared memory"}
    env = report["environment"]
    assert report["schema"] == 1 and report["status"] == "pass" and env["world_size"] == 2
    assert env["backend"] == "gloo" and "no GPU" in env["backend_reason"] and len(env["hosts"]) == 1
    assert env["shim"] == "smdistributed.modelparallel.torch -> smp_compat"
    assert [r["device"] for r in env["ranks"]] == ["cpu", "cpu"]
    key = os.environ[KEY_ENV]  # conftest's: every rank reports it, and where the path came from
    assert all(r["checkpoint_key"].startswith(f"{key} (") and KEY_ENV in r["checkpoint_key"] for r in env["ranks"])
    assert f"checkpoint key (rank 0): {key}" in " ".join(output.split())  # rich may wrap the line
    assert "smp-compat selftest" in output and "16 passed, 0 failed, 2 skipped" in output


@pytest.mark.slow  # 12-18 s: CI's slow step runs it (the default run stays under 10 minutes)
def test_four_ranks_pass(tmp_path: Path) -> None:
    """Every check but those with Hugging Face models, which cost four imports of transformers on two cores here:
    they run at 2 ranks above (tp2-hf also at 4 in tests/nn/test_tp_gpt2.py; v2-tp2-hsd2 below)."""
    names = [c.name for c in CHECKS if c.name != "tp2-hf" and not c.name.startswith("v2-")]
    code, output, report, _ = _selftest(tmp_path, 4, "--checks", ",".join(names))
    assert code == 0, output[-6000:]
    checks = _by_name(report)
    assert list(checks) == names
    assert all(c["status"] == "PASS" for c in checks.values()), {n: c["reason"] for n, c in checks.items()}
    assert checks["pp2-spread"]["layout"] == "pp2×dp2 spread" and checks["tp2"]["layout"] == "tp2×dp2"


@pytest.mark.hf
@pytest.mark.slow  # 12-18 s: CI's slow step runs it (the default run stays under 10 minutes)
def test_four_ranks_smp_v2_tp_times_hybrid_shard(tmp_path: Path) -> None:
    code, output, report, _ = _selftest(tmp_path, 4, "--checks", "v2-tp2-hsd2")
    assert code == 0, output[-6000:]
    check = _by_name(report)["v2-tp2-hsd2"]
    assert check["status"] == "PASS" and check["layout"] == "tp2×shard2×rep1", check


def test_a_rank_that_dies_is_named_and_the_job_ends_at_once(tmp_path: Path) -> None:
    code, output, report, seconds = _selftest(tmp_path, 2, "--checks", "dp,pp2-simple,pp2-interleaved",
                                              **{FAULT_ENV: "pp2-simple:die:1"})  # fmt: skip
    assert code != 0
    checks = _by_name(report)
    assert checks["dp"]["status"] == "PASS"
    died = checks["pp2-simple"]
    assert died["status"] == "FAIL" and died["first_failure"]["rank"] == 1, died
    assert "gave no result" in died["first_failure"]["error"]
    assert died["seconds"] < 20, died  # the grace after the death, not the 60 s collective timeout
    assert seconds < TIMEOUT_S / 2, seconds
    assert checks["pp2-interleaved"]["status"] == "SKIP" and "not run" in checks["pp2-interleaved"]["reason"]
    assert report["status"] == "fail" and "rank 1: gave no result" in output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nproc", [1, 2])
def test_on_a_gpu_nothing_fails(tmp_path: Path, nproc: int) -> None:
    """One process per GPU talks NCCL; more processes than GPUs share them over gloo (sdp2 then skips)."""
    code, output, report, _ = _selftest(tmp_path, nproc)
    assert code == 0, output[-6000:]
    env = report["environment"]
    assert all(r["device"].startswith("cuda") for r in env["ranks"])
    assert env["backend"] == ("nccl" if nproc <= torch.cuda.device_count() else "gloo")
    assert not [c for c in report["checks"] if c["status"] == "FAIL"]


# ---------------------------------------------------------------- faults that leave the job running: forked ranks


def _worker(argv: list[str]) -> int:
    from smp_compat.selftest.worker import main

    return main(argv)


def test_wrong_gradients_and_lost_or_corrupted_messages_fail_their_checks(tmp_path: Path) -> None:
    """One job: each faulted check FAILs, and the battery goes on (the last check passes after a lost message)."""
    report = tmp_path / "report.json"
    faults = "pp2-simple:scale:1,pp2-interleaved:drop:0,amp:corrupt:0"
    argv = ["--checks", "dp,pp2-simple,pp2-interleaved,amp,activation-checkpointing", "--json", str(report)]
    codes = run_ranks(_worker, 2, argv, env={FAULT_ENV: faults, "SMP_PIPELINE_TIMEOUT_S": "3"}, timeout=120)
    assert codes == [1, 0]  # rank 0 reports the failures
    checks = _by_name(json.loads(report.read_text()))
    assert checks["dp"]["status"] == checks["activation-checkpointing"]["status"] == "PASS"
    scaled = checks["pp2-simple"]
    assert scaled["status"] == "FAIL" and scaled["first_failure"]["rank"] == 1, scaled  # rank 1 diverged first
    assert "after step 1" in scaled["first_failure"]["error"]
    dropped = checks["pp2-interleaved"]
    assert dropped["status"] == "FAIL" and "SMPTimeoutError" in dropped["first_failure"]["error"], dropped
    assert dropped["seconds"] < 15, dropped
    corrupted = checks["amp"]
    assert corrupted["status"] == "FAIL" and "the loss of step 1" in corrupted["first_failure"]["error"], corrupted


def test_one_rank_failing_alone_does_not_hang_the_others(tmp_path: Path) -> None:
    """Rank 1 raises while rank 0 waits for it in a collective: rank 0's report names rank 1, in seconds."""
    report = tmp_path / "report.json"
    start = time.monotonic()
    with pytest.raises(RankFailure) as failed:
        run_ranks(_worker, 2, ["--checks", "dp,pp2-simple", "--json", str(report)], env={FAULT_ENV: "dp:raise:1"},
                  timeout=120)  # fmt: skip
    assert time.monotonic() - start < 60 and "exited with code 1" in str(failed.value)
    checks = _by_name(json.loads(report.read_text()))
    dp = checks["dp"]
    assert dp["status"] == "FAIL" and dp["first_failure"]["rank"] == 1, dp
    assert "InjectedFault" in dp["first_failure"]["error"] and dp["failed_ranks"] == [0, 1]
    assert checks["pp2-simple"]["status"] == "SKIP"


def test_unknown_check_is_refused_before_launching(capsys: pytest.CaptureFixture[str]) -> None:
    from smp_compat.cli import main

    assert main(["selftest", "--checks", "dp,nope", "--nproc-per-node", "2"]) == 2
    assert "unknown check(s) nope" in capsys.readouterr().err


def test_docs_tell_users_to_run_it_first_and_describe_every_field_of_the_report() -> None:
    from dataclasses import fields

    from smp_compat.selftest.environment import Environment, RankInfo
    from smp_compat.selftest.report import CheckReport

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    porting = readme[readme.index("## Porting an SMP script") :]
    assert "smp-compat selftest" in porting[: porting.index("\n## ", 5)]
    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    section = page[page.index("## `smp-compat selftest`") : page.index("## Hangs and stopped jobs")]
    for cls in (CheckReport, Environment, RankInfo):
        for f in fields(cls):
            assert f"`{f.name}`" in section, f"docs/troubleshooting.md does not describe {cls.__name__}.{f.name}"
    for check in [*CHECKS, "user-config"]:
        name = getattr(check, "name", check)
        assert f"`{name}`" in section, name
