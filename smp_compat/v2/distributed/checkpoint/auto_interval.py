"""SMP's automatic checkpoint interval (HyperPod's ``auto_checkpoint``), exported by
``torch.sagemaker.distributed.checkpoint.state_dict_utils`` as ``_Interval`` and
``compute_auto_checkpoint_interval``.

HyperPod's training adapter times a few steps with an asynchronous local checkpoint and a few without, then asks
for the interval; it keeps the answer in its checkpoints (``dataclasses.asdict`` / ``_Interval(**saved)``). SMP
documents no formula. Ours: the fewest steps between two checkpoints such that the background write of one ends
before the next begins (``ceil(io / step)``), and at least as many as keep the steps' checkpoint overhead (the
extra time of a step that checkpoints) under 10 % of training time. Every rank gets the same interval: the
durations are the slowest rank's (a max over the world), since all ranks must checkpoint at the same steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["OVERHEAD_FRACTION", "_Interval", "compute_auto_checkpoint_interval"]

OVERHEAD_FRACTION = 0.1
"""The share of training time the checkpoints' extra step time may take."""


@dataclasses.dataclass(init=False)
class _Interval:
    """The interval in steps (<= 0: not computed yet) and the mean durations (s) it came from."""

    interval: int = -1
    step_duration: float = -1.0
    step_ckpt_duration: float = -1.0
    ckpt_preprocessing_duration: float = -1.0
    ckpt_io_duration: float = -1.0

    def __init__(self, interval: int = -1, step_duration: float = -1.0, step_ckpt_duration: float = -1.0,
                 ckpt_preprocessing_duration: float = -1.0, ckpt_io_duration: float = -1.0,
                 **_: Any) -> None:  # fmt: skip
        """Keyword arguments this version does not know (a real SMP's saved fields) are ignored."""
        self.interval = int(interval)
        self.step_duration = float(step_duration)
        self.step_ckpt_duration = float(step_ckpt_duration)
        self.ckpt_preprocessing_duration = float(ckpt_preprocessing_duration)
        self.ckpt_io_duration = float(ckpt_io_duration)


def _slowest(means: list[float]) -> list[float]:
    """``means`` with each entry the maximum over the ranks (unchanged without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return means
    values = torch.tensor(means, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def compute_auto_checkpoint_interval(step_durations: Sequence[float], step_ckpt_durations: Sequence[float],
                                     ckpt_preprocessing_durations: Sequence[float],
                                     ckpt_io_durations: Sequence[float]) -> _Interval:  # fmt: skip
    """The checkpoint interval for these timings (module docstring); collective when a process group exists."""
    step, step_ckpt, prep, io = _slowest([_mean(step_durations), _mean(step_ckpt_durations),
                                          _mean(ckpt_preprocessing_durations), _mean(ckpt_io_durations)])  # fmt: skip
    if step <= 0:
        return _Interval(1, step, step_ckpt, prep, io)
    overlap = math.ceil(max(io, 0.0) / step)
    overhead = math.ceil(max(step_ckpt - step, 0.0) / (OVERHEAD_FRACTION * step))
    return _Interval(max(1, overlap, overhead), step, step_ckpt, prep, io)
