"""Stand-in for ``megatron.core.dist_checkpointing.mapping``: the exception class scripts import."""

from __future__ import annotations

from smp_compat.errors import CheckpointError
from smp_compat.v2.standins import absent_names

__all__ = ["CheckpointingException"]


class CheckpointingException(CheckpointError):
    """megatron-core's checkpoint error; smp_compat's CheckpointError, so one ``except`` catches both."""


__getattr__ = absent_names(__name__)  # a name not provided raises ImportError, as absence would
