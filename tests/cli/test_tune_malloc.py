"""Freed memory stays in the heap: by default in a CPU pipeline, or as ``smp-compat run --[no-]tune-malloc`` says
(the launcher side: test_bind_cores.py)."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys
import textwrap

import pytest

import smp_compat.globalstate
import smp_compat.host.heap
from smp_compat.cli.run import plan_launch
from smp_compat.globalstate import tune_from_environment
from smp_compat.host.heap import TUNE_MALLOC_ENV
from smp_compat.testing import run_ranks

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's"
)

# A fresh interpreter without torch (whose import moves glibc's adaptive thresholds): eight 1 MiB blocks
# written and freed, five times; prints the minor page faults of each round.
_ROUNDS = textwrap.dedent(
    """
    import ctypes, importlib.util, resource, sys
    spec = importlib.util.spec_from_file_location("heap", sys.argv[1])
    heap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heap)
    if sys.argv[2] == "tuned":
        assert heap.keep_freed_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    faults = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(1 << 20) for _ in range(8)]
        for b in blocks:
            ctypes.memset(b, 1, 1 << 20)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(*faults)
    """
)


def _faults_per_round(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, smp_compat.host.heap.__file__, mode],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [int(n) for n in out.stdout.split()]


def test_the_switch_decides_and_unset_means_on_only_in_a_cpu_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    called = []
    monkeypatch.setattr(smp_compat.globalstate, "keep_freed_memory", lambda: called.append(1) or True)
    assert tune_from_environment({}) is False
    assert tune_from_environment({TUNE_MALLOC_ENV: "0"}, pipelined_on_cpu=True) is False
    assert tune_from_environment({TUNE_MALLOC_ENV: "false"}, pipelined_on_cpu=True) is False
    assert called == []
    assert tune_from_environment({}, pipelined_on_cpu=True) is True
    assert tune_from_environment({TUNE_MALLOC_ENV: "1"}) is True
    assert called == [1, 1]


def _init_and_report_tuning(pp: int) -> bool:
    """Whether smp.init tuned malloc (the call is recorded, not made: the test process stays as it is)."""
    import smp_compat as smp
    import smp_compat.globalstate as globalstate

    called: list[int] = []
    globalstate.keep_freed_memory = lambda: called.append(1) or True
    smp.init({"pipeline_parallel_degree": pp, "ddp": True})
    return bool(called)


@pytest.mark.parametrize(("pp", "tuned"), [(2, True), (1, False)])
def test_smp_init_tunes_malloc_by_default_in_a_cpu_pipeline_only(pp: int, tuned: bool) -> None:
    assert run_ranks(_init_and_report_tuning, 2, pp, env={TUNE_MALLOC_ENV: ""}, timeout=120) == [tuned] * 2


@glibc_only
def test_freed_memory_is_faulted_in_again_by_default_and_kept_when_tuned() -> None:
    default, tuned = _faults_per_round("default"), _faults_per_round("tuned")
    pages = 8 * (1 << 20) // resource.getpagesize()
    assert min(default[1:]) > pages // 2, default  # glibc gave the 8 MiB back each round
    assert max(tuned[1:]) < pages // 16, tuned  # kept: written again without faults


def test_run_exports_the_no_form_as_off(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    plan = plan_launch(["--no-tune-malloc", "--nproc-per-node", "2", str(script)], environ={})
    assert plan.env_updates[TUNE_MALLOC_ENV] == "0"
    assert "--no-tune-malloc" not in plan.command  # torchrun does not know it


def test_a_preloaded_allocator_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert smp_compat.host.heap.keep_freed_memory() is False
    assert tune_from_environment({}, pipelined_on_cpu=True) is False
