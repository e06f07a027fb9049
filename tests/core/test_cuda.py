"""CUDA paths, against plain PyTorch on the same GPU: skipped on machines without one (CI has none).

Run on a GPU machine with `python -m pytest -q tests/test_cuda.py`. Processes beyond the GPU count share
GPUs over gloo (NCCL refuses two ranks on one GPU); one process per GPU uses NCCL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask NVML: this process must not initialize CUDA
import torch  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "fixtures" / "cuda" / "train_cuda.py"
PARALLEL_JOB = ROOT / "tests" / "fixtures" / "cuda" / "parallel_cuda.py"


def _torchrun(nproc: int, config: dict | None, *extra: str, job: Path = JOB) -> list[dict]:
    args = [json.dumps(config)] if config is not None else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
           str(job), *args, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == nproc, proc.stdout
    return lines


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _expected_backend(nproc: int) -> str:
    return "nccl" if nproc <= torch.cuda.device_count() else "gloo"


@pytest.mark.parametrize("microbatches", [1, 4])
def test_pp1_on_cuda_matches_plain_pytorch(microbatches: int) -> None:
    (out,) = _torchrun(1, {"microbatches": microbatches, "ddp": True})
    assert out["on_cuda"] and out["backend"] == "nccl"


def test_pp1_amp_fp16_on_cuda_matches_plain_pytorch() -> None:
    _torchrun(1, {"microbatches": 2, "ddp": True}, "amp")


def test_dp2_on_cuda_matches_plain_pytorch() -> None:
    outs = _torchrun(2, {"microbatches": 2, "ddp": True})
    assert all(o["on_cuda"] and o["backend"] == _expected_backend(2) for o in outs)


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
def test_pp2_on_cuda_matches_plain_pytorch(pipeline: str) -> None:
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": pipeline, "default_partition": 0,
           "auto_partition": False}
    outs = _torchrun(2, cfg)
    assert all(o["on_cuda"] for o in outs)


def test_pp2_dp2_on_cuda_matches_plain_pytorch() -> None:
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "default_partition": 0,
           "auto_partition": False}
    outs = _torchrun(4, cfg)
    assert all(o["on_cuda"] for o in outs)


def test_tensor_parallelism_on_cuda_matches_plain_pytorch() -> None:
    outs = _torchrun(2, None, "tp", job=PARALLEL_JOB)
    assert all(o["on_cuda"] and o["backend"] == _expected_backend(2) for o in outs)


def test_sharded_data_parallelism_on_cuda_matches_plain_pytorch_or_needs_a_gpu_per_process() -> None:
    if _expected_backend(2) == "nccl":
        assert all(o["on_cuda"] for o in _torchrun(2, None, "sdp", job=PARALLEL_JOB))
        return
    with pytest.raises(AssertionError, match="FSDP2's collectives on CUDA tensors need NCCL"):
        _torchrun(2, None, "sdp", job=PARALLEL_JOB)  # one GPU shared over gloo: a clear error, not a crash
