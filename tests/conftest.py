"""Test setup: tests import the shared models as `models`, and smp state is reset around each test."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True, scope="session")
def _checkpoint_key(tmp_path_factory: pytest.TempPathFactory):
    """Checkpoint digests use a key in a temporary folder, never the real ~/.config (subprocesses inherit it)."""
    from smp_compat.checkpoints.signing import KEY_ENV

    saved = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(tmp_path_factory.mktemp("key") / "checkpoint.key")
    yield
    if saved is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = saved


@pytest.fixture(autouse=True)
def _restore_environ():
    """smp.init exports RANK/WORLD_SIZE/LOCAL_RANK (as SMP did); keep them from leaking into other tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _reset_smp_state():
    from smp_compat.globalstate import reset

    reset()
    yield
    reset()
