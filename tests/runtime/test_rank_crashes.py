"""``run_ranks`` names a rank that a fatal signal ends, before or after it gave its result (issue 42).

A segfault in a training job is a bug to find, never a flake: the report says which rank, which signal, and
the rank's Python stacks (faulthandler) are on stderr, where the test's captured output shows them.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from smp_compat.testing import RankFailure, run_ranks


def _segfault_on_rank_1() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return dist.get_rank()


def _segfault_after_the_result() -> int:
    """Rank 1 crashes while leaving, after its result went out (at teardown, where gloo's aborts were found)."""
    if dist.get_rank() == 1:  # run_ranks' teardown destroys the process group after sending the result
        dist.destroy_process_group = lambda *a, **k: os.kill(os.getpid(), signal.SIGSEGV)  # type: ignore[assignment]
    return dist.get_rank()


def test_a_rank_killed_by_a_signal_is_named_with_the_signal(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_segfault_on_rank_1, 2, timeout=60)
    assert "rank 1: killed by SIGSEGV" in str(failure.value)
    assert "Segmentation fault" in capfd.readouterr().err  # faulthandler's stacks of the dying rank


def test_a_crash_after_the_result_fails_too() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_segfault_after_the_result, 2, timeout=60)
    assert "rank 1: killed by SIGSEGV" in str(failure.value) and "rank 0" not in str(failure.value)
