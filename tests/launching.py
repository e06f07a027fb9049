"""Launching real jobs from tests: a clean environment, a free port, the smp-compat command, ranks run at once."""

from __future__ import annotations

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
    for proc in procs:  # whole process groups: torchrun's workers too
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = "\n".join(
        f"--- process {i} ({shlex.join(cmd)}) exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        for i, ((cmd, _), proc, log) in enumerate(zip(commands, procs, logs, strict=True))
    )
    assert not timed_out, f"timed out after {TIMEOUT_S} s\n{report}"
    assert all(proc.returncode == 0 for proc in procs), report
