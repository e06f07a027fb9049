"""Launching real jobs from tests: a clean environment, a free port, the smp-compat command, ranks run at once."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ROOT", "TIMEOUT_S", "clean_env", "fresh_container_env", "free_port", "run_all", "smp_compat_command"]

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 90
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS", "SMP_MANUAL_INIT",
                "SM_HOSTS")  # fmt: skip
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "PET_")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment minus any launcher or SageMaker variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def fresh_container_env(home: Path, **extra: str) -> dict[str, str]:
    """``clean_env`` as a restarted pod or spot instance sees it: an empty home, no checkpoint key, nothing exported.

    The job's own checkpoints then carry digests no key here verifies (issue 33): they must load as data.
    """
    home.mkdir(parents=True, exist_ok=True)
    env = clean_env(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), **extra)
    env.pop("SMP_COMPAT_CHECKPOINT_KEY_FILE", None)
    env.pop("SMP_COMPAT_TRUST_CHECKPOINTS", None)
    return env


def smp_compat_command() -> list[str]:
    """The installed console script (what users type), or the module when only the source is on the path."""
    script = Path(sys.executable).parent / "smp-compat"
    return [str(script)] if script.exists() else [sys.executable, "-m", "smp_compat.cli"]


def run_all(commands: Sequence[tuple[list[str], Mapping[str, str]]], tmp_path: Path) -> None:
    """Start every command at once (they are ranks of one job), wait with a hard timeout, kill on expiry."""
    procs, logs = [], []
    for i, (cmd, env) in enumerate(commands):
        log = tmp_path / f"proc{i}.log"
        logs.append(log)
        with log.open("w") as handle:
            procs.append(subprocess.Popen(cmd, env=dict(env), cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for proc in procs:
        if proc.poll() is None:
            _kill_tree(proc)
    report = "\n".join(
        f"--- process {i} ({shlex.join(cmd)}) exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        for i, ((cmd, _), proc, log) in enumerate(zip(commands, procs, logs, strict=True))
    )
    assert not timed_out, f"timed out after {TIMEOUT_S} s\n{report}"
    assert all(proc.returncode == 0 for proc in procs), report


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (read from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill a launched command, its process group and every process below it.

    torch elastic starts each worker in a session of its own, so killing the launcher's group alone
    would leave a hung job's workers running (holding ports and CPU) after the test. The group is
    stopped first so that it cannot start another worker while its tree is read.
    """
    with contextlib.suppress(ProcessLookupError):  # it may have ended since it was polled
        os.killpg(proc.pid, signal.SIGSTOP)
    below = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group in (os.getpgrp(), proc.pid):
                os.kill(pid, signal.SIGKILL)
            else:  # a worker's own session: its children too
                os.killpg(group, signal.SIGKILL)
    proc.wait()
