"""The test helper that launches jobs (tests/launching.py): a timed-out job leaves no process behind."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import launching
from launching import clean_env, run_all

__all__: list[str] = []

# a launcher in the manner of torch elastic's agent: its worker runs in a session of its own
_AGENT = """
import subprocess, sys, time
worker = subprocess.Popen(["sleep", "600"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_timed_out_job_leaves_no_worker_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launching, "TIMEOUT_S", 5)
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(AssertionError, match="timed out after 5 s"):
        run_all([([sys.executable, "-c", _AGENT, str(pid_file)], clean_env())], tmp_path)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(worker), f"worker {worker} outlived its timed-out launcher"
