"""The multi-process fidelity jobs give the same bits on a busy machine as on a quiet one (issue 42).

Each job runs once as it is, then again while a CPU hog keeps every core busy (two spinning processes per
core, ended with the test). Timing then changes everywhere: which rank reaches a collective first, how long a
gloo transfer takes, when a background thread runs. Nothing of that may reach the numbers: losses, gradient
norms and every parameter must be equal bit for bit, on every rank. Marked ``soak`` (minutes): ``.ci/run``
runs it in its ``-m "soak or slow"`` step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_hog import cpu_hog

from smp_compat.testing import run_ranks

pytestmark = pytest.mark.soak

TESTS = Path(__file__).resolve().parents[1]
for folder in ("sdp", "v2", "runtime"):  # the jobs are those of the fidelity tests, imported from their files
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))

import test_determinism as pp  # noqa: E402
import test_sdp_16bit as sdp16  # noqa: E402
import test_sdp_tp as sdptp  # noqa: E402
import test_transform_tp as v2tp  # noqa: E402

TIMEOUT_S = 400  # a 4-rank job with two hogs per core on the 2-core machine


def _jobs(tmp: Path) -> dict[str, tuple[Callable[..., Any], int, tuple[Any, ...]]]:
    """Per name: the rank function of a fidelity test, its world size and its arguments."""
    return {
        "sdp2-bf16": (sdp16._sdp_run, 2, (2, "bf16", sdp16.LR, sdp16.STEPS)),
        "sdp2-fp16": (sdp16._sdp_run, 2, (2, "fp16", sdp16.LR, sdp16.STEPS)),
        "tp2xsdp2-gpt2": (sdptp._fidelity, 4, ("gpt2", False, False, str(tmp / "tp2xsdp2"))),
        "pp2-deterministic": (pp._run, 2, (str(tmp / "pp2"), range(pp.STEPS), None, False)),
        "v2-tp2xhsd2-llama": (v2tp._train_tp2, 4, ("llama",)),
    }


def _differences(quiet: Any, busy: Any, where: str = "") -> list[str]:
    """Where two results differ, bit for bit (tensors by their bytes, so that -0.0 and NaN compare too)."""
    if isinstance(quiet, torch.Tensor):
        same = (isinstance(busy, torch.Tensor) and quiet.dtype == busy.dtype and quiet.shape == busy.shape
                and bool((quiet.view(-1).view(torch.uint8) == busy.view(-1).view(torch.uint8)).all()))  # fmt: skip
        return [] if same else [where]
    if isinstance(quiet, dict):
        if not isinstance(busy, dict) or quiet.keys() != busy.keys():
            return [f"{where} (keys)"]
        return [d for k in quiet for d in _differences(quiet[k], busy[k], f"{where}.{k}")]
    if isinstance(quiet, (list, tuple)):
        if not isinstance(busy, (list, tuple)) or len(quiet) != len(busy):
            return [f"{where} (length)"]
        return [d for i, (q, b) in enumerate(zip(quiet, busy)) for d in _differences(q, b, f"{where}[{i}]")]
    return [] if quiet == busy else [f"{where}: {quiet!r} != {busy!r}"]


def _contiguous(result: Any) -> Any:
    """Tensors made contiguous and detached, so that their bytes can be compared."""
    if isinstance(result, torch.Tensor):
        return result.detach().contiguous()
    if isinstance(result, dict):
        return {k: _contiguous(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        return [_contiguous(v) for v in result]
    return result


@pytest.mark.parametrize("job", ["sdp2-bf16", "sdp2-fp16", "tp2xsdp2-gpt2", "pp2-deterministic", "v2-tp2xhsd2-llama"])
def test_a_busy_machine_gives_the_quiet_runs_bits(job: str, tmp_path: Path) -> None:
    fn, world, args = _jobs(tmp_path)[job]
    quiet = _contiguous(run_ranks(fn, world, *args, timeout=TIMEOUT_S))
    with cpu_hog():
        busy = _contiguous(run_ranks(fn, world, *args, timeout=TIMEOUT_S))
    differences = _differences(quiet, busy, "ranks")
    assert not differences, f"{job}: {len(differences)} results differ under load: {differences[:8]}"
