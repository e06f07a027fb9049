"""Test setup: tests import the shared models as `models`, and smp state is reset around each test."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True, scope="session")
def _temporary_user_paths(tmp_path_factory: pytest.TempPathFactory):
    """Checkpoint digests use a key in a temporary folder, never the real ~/.config, and `smp-compat run`'s
    default job folder is temporary too, not the repository (subprocesses inherit both)."""
    from smp_compat.checkpoints.signing import KEY_ENV

    from smp_compat.cli.sm_env import JOB_DIR_ENV

    saved = {name: os.environ.get(name) for name in (KEY_ENV, JOB_DIR_ENV)}
    os.environ[KEY_ENV] = str(tmp_path_factory.mktemp("key") / "checkpoint.key")
    os.environ[JOB_DIR_ENV] = str(tmp_path_factory.mktemp("smp-compat-job"))  # `smp-compat run` writes no job here
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _restore_environ():
    """smp.init exports RANK/WORLD_SIZE/LOCAL_RANK (as SMP did); keep them from leaking into other tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Each test computes in this process with one torch thread, as every rank ``run_ranks`` forks does, and
    leaves the count as it found it.

    torch's CPU results depend on the thread count (how a matmul or a reduction is split): the 16-bit
    oracle's step-5 gradient norm is 1.04180 with one thread, 1.04333 with two. Before this, a test's
    reference depended on the machine's core count and on the tests before it: ``test_mnist_in_a_world_of_one``
    runs an example that calls ``torch.set_num_threads(1)`` in this process, so every later test's oracle
    differed from the same test run alone.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _reset_smp_state():
    from smp_compat.globalstate import reset
    from smp_compat.v2.state import reset as reset_v2

    reset()
    reset_v2()
    yield
    reset()
    reset_v2()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the quick tier (tests/quick_tier.py) so that ``pytest -m quick`` runs it."""
    from quick_tier import is_quick

    for item in items:
        if is_quick(item.nodeid):
            item.add_marker(pytest.mark.quick)
