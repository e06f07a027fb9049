"""The CPU mode (smp_compat/host/cuda_on_cpu.py): an SMP script's unguarded torch.cuda calls answered on a machine
with no CUDA device, never where CUDA is available, never to libraries, and off with SMP_COMPAT_CPU_CUDA=0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from launching import ROOT, clean_env, free_port, run_all, smp_compat_command
from smp_compat.cli.run import plan_launch
from smp_compat.host import cuda_on_cpu
from smp_compat.host.cuda_on_cpu import CPU_CUDA_ENV, SERVED, install, installed
from smp_compat.shim import SITE_DIR

SCRIPT = ROOT / "tests" / "v2" / "scripts" / "cuda_calls.py"
HERE = Path(__file__).parent
"""The folder of the 'script' the in-process tests stand for: their own calls are served."""


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.cuda's functions put back after the test (install replaces them in this process)."""
    monkeypatch.delenv(CPU_CUDA_ENV, raising=False)
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in
             (cuda_on_cpu._owner(torch.cuda, name) for name in SERVED) if owner is not None]  # fmt: skip
    yield
    for owner, attr, real in saved:
        setattr(owner, attr, real)


def _call_as(module: str, filename: str, expression: str) -> object:
    """Evaluate ``expression`` as code of ``module`` in ``filename`` would (what the caller check sees)."""
    return eval(compile(expression, filename, "eval"), {"__name__": module, "torch": torch})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode is for machines without CUDA")
def test_served_to_the_script_once_announced_and_not_to_libraries(restored: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert install(torch, script_dir=str(HERE)) and installed(torch) and not install(torch)  # the second: nothing
    assert 5 % torch.cuda.device_count() == 0 and torch.cuda.current_device() == 0
    for _ in range(2):
        torch.cuda.set_device(0)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.range_pop()
        with torch.cuda.nvtx.range("x"):
            pass
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.reset_peak_memory_stats()
    assert not torch.cuda.is_available() and not torch.cuda.is_initialized()
    err = capsys.readouterr().err
    for name in ("device_count", "set_device", "synchronize", "nvtx.range_push", "cudart", "reset_peak_memory_stats"):
        assert err.count(f"torch.cuda.{name}() served on CPU") == 1, err  # once per process
    # the script's other modules and code in no file are served; torch, smp_compat and any package, wherever
    # installed (site-packages, a --target folder on PYTHONPATH), get torch's own answers
    assert _call_as("memory_tracker", str(HERE / "data" / "memory_tracker.py"), "torch.cuda.device_count()") == 1
    assert _call_as("__main__", "<string>", "torch.cuda.device_count()") == 1
    assert _call_as("runpy", "<frozen runpy>", "torch.cuda.device_count()") == 0
    assert _call_as("torch.distributed.fsdp._x", str(HERE / "x.py"), "torch.cuda.device_count()") == 0
    assert _call_as("smp_compat.v2.startup", str(HERE / "x.py"), "torch.cuda.device_count()") == 0
    site_file = os.path.join(sysconfig.get_paths()["purelib"], "transformers", "x.py")
    assert _call_as("transformers.x", site_file, "torch.cuda.device_count()") == 0
    assert _call_as("accelerate.utils", "/opt/extra/accelerate/utils.py", "torch.cuda.device_count()") == 0
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        _call_as("transformers.x", site_file, "torch.cuda.synchronize()")


def test_not_installed_where_cuda_is_available(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not install(torch) and not installed(torch) and torch.cuda.synchronize is real


def test_not_installed_when_opted_out(restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CPU_CUDA_ENV, "0")
    assert not install(torch) and not installed(torch)


def test_run_flag_exports_the_opt_out(tmp_path: Path) -> None:
    base = ["--job-dir", str(tmp_path), str(SCRIPT)]
    assert CPU_CUDA_ENV not in plan_launch(base, {}).env_updates  # default: on, nothing exported
    assert plan_launch(["--no-cpu-cuda", *base], {}).env_updates[CPU_CUDA_ENV] == "0"
    plan = plan_launch(["--cpu-cuda", *base], {})
    assert plan.env_updates[CPU_CUDA_ENV] == "1" and "--cpu-cuda" not in plan.command


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode is for machines without CUDA")
def test_aws_cuda_calls_run_unmodified_under_smp_compat_run(tmp_path: Path) -> None:
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--job-dir", str(tmp_path / "job"), "--config", '{"hybrid_shard_degree": 2}', str(SCRIPT),
           "--out", str(tmp_path)]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # the reference: the same step in one process of plain torch, each rank's batch (FSDP averages the grads)
    for rank, report in enumerate(reports):
        assert report["device"] == 0 and report["current_device"] == 0 and not report["is_available"]
        assert report["param_device"] == "cpu" and report["memory"] == [0, 0, 0, 0]
        torch.manual_seed(0)
        assert report["loss"] == pytest.approx(torch.nn.Linear(4, 2)(torch.full((3, 4), rank + 1.0)).square().mean().item())
    log = (tmp_path / "proc0.log").read_text()
    for name in ("device_count", "set_device", "current_device", "synchronize", "nvtx.range_push", "nvtx.range_pop",
                 "cudart", "reset_peak_memory_stats"):  # fmt: skip
        for rank in range(2):
            assert log.count(f"rank {rank}: torch.cuda.{name}() served on CPU") == 1, log


_FIND_THEN_IMPORT = ("import importlib.util; importlib.util.find_spec('torch'); import torch; "
                     "print(torch.cuda.device_count(), torch.cuda.is_available())")
"""transformers asks importlib.util.find_spec("torch") before importing it: the hook must survive a find."""


def _worker(value: str) -> subprocess.CompletedProcess[str]:
    """A process as ``smp-compat run`` starts it (the shim's sitecustomize on PYTHONPATH), the mode at ``value``."""
    env = clean_env(PYTHONPATH=SITE_DIR, **{CPU_CUDA_ENV: value})
    return subprocess.run([sys.executable, "-c", _FIND_THEN_IMPORT], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode is for machines without CUDA")
def test_the_launchers_sitecustomize_installs_it_when_torch_is_imported() -> None:
    out = _worker("1")
    assert out.returncode == 0 and out.stdout.split() == ["1", "False"], out.stderr
    assert out.stderr.count("torch.cuda.device_count() served on CPU") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode is for machines without CUDA")
def test_the_variable_turns_it_off_in_a_launched_process() -> None:
    out = _worker("0")
    assert out.returncode == 0 and out.stdout.split() == ["0", "False"], out.stderr
    assert "served on CPU" not in out.stderr
