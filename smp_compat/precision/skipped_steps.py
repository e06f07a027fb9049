"""Make skipped optimizer steps visible: a run that never steps must not look like one that trains.

The fp16 dynamic scaler starts at 2^32 (SMP's default), so the first ~15-20 steps of a normal fp16 run
overflow and are skipped: that is expected, and logged once. A run whose every step is skipped for
``SMP_SKIPPED_STEPS_WARN_AFTER`` consecutive steps (default 50) trains nothing while exiting 0; it is
warned about once, loudly, with the usual causes.
"""

from __future__ import annotations

import os
import warnings

from smp_compat.globalstate import log, state

__all__ = ["SkippedStepsWarning", "SkipWatch", "SKIPPED_STEPS_ENV", "DEFAULT_WARN_AFTER"]

SKIPPED_STEPS_ENV = "SMP_SKIPPED_STEPS_WARN_AFTER"
DEFAULT_WARN_AFTER = 50


class SkippedStepsWarning(RuntimeWarning):
    """Every optimizer step of the last N was skipped for a gradient overflow: nothing is training."""


def warn_after() -> int:
    """Consecutive skipped steps before the loud warning (``SMP_SKIPPED_STEPS_WARN_AFTER``; 0 turns it off)."""
    value = os.environ.get(SKIPPED_STEPS_ENV, "")
    try:
        return int(value) if value.strip() else DEFAULT_WARN_AFTER
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", SKIPPED_STEPS_ENV, value, DEFAULT_WARN_AFTER)
        return DEFAULT_WARN_AFTER


class SkipWatch:
    """Counts consecutive skipped steps; one log line at the first skip, one warning at the limit.

    Every rank agrees on skipping (the overflow flag is all-reduced), so only global rank 0 speaks.
    """

    def __init__(self) -> None:
        self.consecutive = 0
        self._logged_first = False
        self._warned = False
        self._limit = warn_after()

    def record(self, skipped: bool, loss_scale: float, dynamic: bool) -> None:
        """Called once per ``optimizer.step()`` with whether it was skipped and the scale after the update."""
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        if state.rank != 0:
            return
        if not self._logged_first:
            self._logged_first = True
            log.warning("%s (logged once)", _first_skip(loss_scale, dynamic))
        if self._limit > 0 and self.consecutive == self._limit and not self._warned:
            self._warned = True
            warnings.warn(_message(self.consecutive, loss_scale), SkippedStepsWarning, stacklevel=3)


def _first_skip(loss_scale: float, dynamic: bool) -> str:
    if dynamic:
        return (
            f"gradient overflow: optimizer step skipped, loss scale lowered to {loss_scale:g}; expected while "
            "the dynamic scale comes down (from SMP's default 2^32 that takes ~17-20 steps)"
        )
    return f"gradient overflow (inf/nan gradients): optimizer step skipped (loss scale {loss_scale:g})"


def _message(count: int, loss_scale: float) -> str:
    return (
        f"smp_compat: the optimizer skipped all of the last {count} steps for a gradient overflow (inf/nan "
        f"gradients; loss scale now {loss_scale:g}), so the model is NOT training. Likely causes: a static "
        "loss scale too large for fp16 (use dynamic_loss_scale=True, or a smaller static_loss_scale); a "
        "min_scale in dynamic_loss_args that keeps the scale too high; a loss or activation that is itself "
        "inf/nan (check the loss of a step, try bf16 or fp32); a learning rate that made the weights diverge. "
        f"Set {SKIPPED_STEPS_ENV}=0 to silence this warning, or to another count to change when it appears."
    )
