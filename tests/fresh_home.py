"""A rank as a restarted container (issue 33): an empty home, no key variable, no trust variable, no flag."""

from __future__ import annotations

import os
from pathlib import Path

from smp_compat.checkpoints.load_policy import TRUST_ENV
from smp_compat.checkpoints.signing import KEY_ENV, key_path

__all__ = ["fresh_container"]


def fresh_container(home: str) -> Path:
    """Make this process a container whose home is ``home``; returns where its checkpoint key would be.

    Call it first in a forked rank (``run_ranks``): the session's key variable (tests/conftest.py) is
    dropped, so digests made under another home verify nothing here, as after a pod or spot restart.
    """
    os.environ.pop(KEY_ENV, None)
    os.environ.pop(TRUST_ENV, None)
    os.environ["HOME"] = home
    os.environ["XDG_CONFIG_HOME"] = os.path.join(home, ".config")
    return key_path()
