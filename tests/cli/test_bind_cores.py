"""``smp-compat run --bind-cores``: the launcher exports the switch (and ``--tune-malloc``'s), and smp.init pins each
local rank."""

from __future__ import annotations

import os

import pytest

import smp_compat as smp
from smp_compat.globalstate import BIND_ENV, bind_from_environment, core_share
from smp_compat.cli.run import plan_launch
from smp_compat.host.heap import TUNE_MALLOC_ENV
from smp_compat.testing import run_ranks

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux core affinity")


@pytest.mark.parametrize(
    ("cores", "size", "expected"),
    [
        (range(8), 2, [{0, 1, 2, 3}, {4, 5, 6, 7}]),
        (range(10), 4, [{0, 1, 2}, {3, 4, 5}, {6, 7}, {8, 9}]),
        (range(2), 4, [{0}, {1}, {0}, {1}]),
        ([5, 3], 2, [{3}, {5}]),
    ],
)
def test_core_share_splits_cores_into_contiguous_disjoint_slices(cores, size, expected) -> None:
    assert [core_share(list(cores), r, size) for r in range(size)] == expected


def test_core_share_rejects_a_rank_outside_the_node() -> None:
    with pytest.raises(ValueError, match="local rank 2 of 2"):
        core_share([0, 1], 2, 2)


@pytest.mark.parametrize(("flag", "variable"), [("--bind-cores", BIND_ENV), ("--tune-malloc", TUNE_MALLOC_ENV)])
def test_run_exports_each_switch_only_when_asked(tmp_path, flag: str, variable: str) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    on = plan_launch([flag, "--nproc-per-node", "2", str(script)], environ={})
    assert on.env_updates[variable] == "1"
    assert flag not in on.command  # torchrun does not know it
    off = plan_launch(["--nproc-per-node", "2", str(script)], environ={})
    assert variable not in off.env_updates


def test_unset_switch_leaves_the_affinity_alone() -> None:
    before = os.sched_getaffinity(0)
    assert bind_from_environment(0, 2, environ={}) is None
    assert os.sched_getaffinity(0) == before


def _init_and_report() -> tuple[list[int], list[int], list[int]]:
    """Affinity of the main thread and of a thread started after smp.init (it inherits the mask)."""
    import threading

    allowed = sorted(os.sched_getaffinity(0))
    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
    worker.start()
    worker.join()
    return allowed, sorted(os.sched_getaffinity(0)), seen


def test_smp_init_pins_each_local_rank_to_its_share() -> None:
    results = run_ranks(_init_and_report, 2, env={BIND_ENV: "1"}, timeout=120)
    for rank, (allowed, main, later) in enumerate(results):
        assert main == sorted(core_share(allowed, rank, 2))
        assert later == main
    if len(results[0][0]) >= 2:
        assert not set(results[0][1]) & set(results[1][1])  # disjoint when there are cores enough
