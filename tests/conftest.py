"""Test setup: tests import the shared models as `models`, and smp state is reset around each test."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
