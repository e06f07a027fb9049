"""Fault injection, for smp_compat's own tests of the selftest: proof that a broken run is reported, fast.

``SMP_COMPAT_SELFTEST_FAULT=CHECK:KIND:RANK[,CHECK:KIND:RANK...]`` breaks a check on one rank (several checks
with several faults, comma-separated):

- ``scale``: the rank's gradients are doubled after the backward pass (a wrong gradient or loss scale);
- ``corrupt``: the first pipeline message the rank sends with tensors arrives with every tensor + 1;
- ``drop``: that message is never sent (its receiver waits until the pipeline timeout);
- ``die``: the rank kills itself (SIGKILL) after the check's first step;
- ``raise``: the rank raises an error after the check's first step.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from smp_compat.errors import SMPConfigError

__all__ = ["FAULT_ENV", "KINDS", "Fault", "Injector", "InjectedFault", "read_faults"]

FAULT_ENV = "SMP_COMPAT_SELFTEST_FAULT"
KINDS = ("scale", "corrupt", "drop", "die", "raise")


class InjectedFault(RuntimeError):
    """The error the ``raise`` fault raises."""


@dataclass(frozen=True)
class Fault:
    check: str
    kind: str
    rank: int


def read_faults(environ: Mapping[str, str] | None = None) -> list[Fault]:
    """The faults ``SMP_COMPAT_SELFTEST_FAULT`` asks for (none when it is unset)."""
    value = (os.environ if environ is None else environ).get(FAULT_ENV, "").strip()
    faults = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[1] not in KINDS or not parts[2].isdigit():
            raise SMPConfigError(
                f"{FAULT_ENV}={value!r}: {item!r} is not CHECK:KIND:RANK with KIND one of {', '.join(KINDS)} "
                "(e.g. pp2-simple:scale:1). It is for testing the selftest itself: unset it."
            )
        faults.append(Fault(parts[0], parts[1], int(parts[2])))
    return faults


class Injector:
    """The hooks a check's training calls; they act only in the faulted check, on the faulted rank."""

    def __init__(self, faults: list[Fault], check: str, rank: int) -> None:
        kinds = [f.kind for f in faults if f.check == check and f.rank == rank]
        self.kind = kinds[0] if kinds else None
        self._sent = False

    def after_backward(self, model: Any, step: int) -> None:
        """After a step's backward pass, before the optimizer's step."""
        if self.kind == "scale":
            for p in model.local_parameters():
                if p.grad is not None:
                    p.grad.mul_(2.0)
        elif self.kind == "die" and step == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "raise" and step == 0:
            raise InjectedFault(f"fault injected by {FAULT_ENV}")

    @contextlib.contextmanager
    def messages(self) -> Iterator[None]:
        """While a step runs: corrupt or drop the first pipeline message with tensors that this rank sends."""
        if self.kind not in ("corrupt", "drop") or self._sent:
            yield
            return
        from smp_compat.runtime.transport import Transport

        original = Transport.send
        injector = self

        def send(transport: Any, dst: int, kind: str, meta: Any = None, tensors: Any = ()) -> None:
            floats = [t for t in tensors if t.is_floating_point()]
            if floats and not injector._sent:
                injector._sent = True
                if injector.kind == "drop":
                    return None
                tensors = [t + 1.0 if t.is_floating_point() else t for t in tensors]
            return original(transport, dst, kind, meta, tensors)

        Transport.send = send  # type: ignore[method-assign]
        try:
            yield
        finally:
            Transport.send = original  # type: ignore[method-assign]

