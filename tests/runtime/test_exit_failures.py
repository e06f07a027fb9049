"""A rank that fails or leaves early is named by the ranks it leaves behind (docs/troubleshooting.md).

Two real processes (plain ``python``, torchrun's variables by hand, so the error leaves through
``sys.excepthook`` and the exit through ``atexit``, as under ``smp-compat run``) train a data-parallel
model; at step 2 rank 1 raises or calls ``sys.exit``. Rank 0, blocked in the gradient all-reduce, gets a
raw gloo "Connection reset/closed by peer"; it must instead stop with the one watch line naming rank 1
and exit with code 17. A clean end of every rank, ``sys.exit(0)`` included, stays silent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launching import ROOT, clean_env, free_port

__all__: list[str] = []

WATCH_EXIT = 17
TIMEOUT_S = 120  # hard limit per process (a hang); a test takes 5-10 s, 30-40 s at a load average of 20 on 2 cores

_SCRIPT = """
import os, sys, time
import torch
from torch import nn
import smp_compat as smp

MODE = os.environ["FAIL_MODE"]
smp.init({"ddp": True, "microbatches": 2})
torch.manual_seed(0)
model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


@smp.step
def train_step(model, x, y):
    loss = ((model(x) - y) ** 2).mean()
    model.backward(loss)
    return loss


for step in range(4):
    if step == 2 and smp.rank() == 1:
        if MODE == "raise":
            raise ValueError("bad batch on rank 1")
        if MODE.startswith("exit"):
            sys.exit(int(MODE[len("exit"):]))
    optimizer.zero_grad()
    train_step(model, torch.randn(8, 8), torch.randn(8, 1))
    optimizer.step()
if MODE == "clean_exit0":
    if smp.rank() == 0:
        time.sleep(1.0)  # rank 1 leaves first; rank 0 is still busy, not in a collective: a normal end
    print(f"rank {smp.rank()} done", flush=True)
    sys.exit(0)
print(f"rank {smp.rank()} done", flush=True)
"""


def _run(tmp_path: Path, mode: str) -> list[subprocess.CompletedProcess[str]]:
    """Both ranks of the job; each one's return code and output."""
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    port = str(free_port())
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    procs = []
    for rank in range(2):
        env = clean_env(FAIL_MODE=mode, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=path)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    results = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _stopped_naming(rank0: subprocess.CompletedProcess[str], cause: str) -> None:
    out = rank0.stdout
    assert rank0.returncode == WATCH_EXIT, f"rank 0 exited {rank0.returncode}:\n{out[-3000:]}"
    assert f"smp_compat: stopping rank 0 because rank 1{cause}" in out, out[-3000:]
    assert "Traceback" not in out and "rank 0 failed" not in out, out[-3000:]  # no raw gloo error of its own


def test_dp_error_on_rank_1_stops_rank_0_naming_the_error(tmp_path: Path) -> None:
    rank0, rank1 = _run(tmp_path, "raise")
    _stopped_naming(rank0, ": ValueError: bad batch on rank 1")
    assert rank1.returncode == 1 and "ValueError: bad batch on rank 1" in rank1.stdout, rank1.stdout[-3000:]


@pytest.mark.parametrize("status", [3, 0])
def test_sys_exit_on_rank_1_stops_rank_0_naming_the_exit(tmp_path: Path, status: int) -> None:
    rank0, rank1 = _run(tmp_path, f"exit{status}")
    _stopped_naming(rank0, f" exited with status {status} before the job finished")
    assert rank1.returncode == status, rank1.stdout[-3000:]


def test_a_clean_end_of_every_rank_stays_silent(tmp_path: Path) -> None:
    """``sys.exit(0)`` at the end, rank 1 first: its exit is only noted, and rank 0 ends normally (code 0)."""
    results = _run(tmp_path, "clean_exit0")
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank} exited {result.returncode}:\n{result.stdout[-3000:]}"
        assert f"rank {rank} done" in result.stdout and "smp_compat:" not in result.stdout, result.stdout[-3000:]
