"""The exception that ended a job, where it came from, and telling the launcher about it.

A module on a later pipeline stage that raises reaches the user as a ``RemoteError`` on the rank that
called it; the original exception's type and message would otherwise be buried inside that error's
text. ``RootCause`` travels with the error (rank, module, microbatch, phase), the one-line failure that
every rank prints leads with it, and the failing ranks write torch elastic's error file
(``TORCHELASTIC_ERROR_FILE``, the JSON that ``torch.distributed.elastic``'s ``ErrorHandler`` writes), so
torchrun's closing "Root Cause" shows it instead of ``error_file: <N/A>``.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass

__all__ = ["ERROR_FILE_ENV", "RootCause", "root_of", "summary", "write_error_file"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


@dataclass(frozen=True)
class RootCause:
    """An exception raised on ``rank`` (inside ``module`` when a pipeline call ran it), as plain strings."""

    kind: str
    message: str
    rank: int
    module: str | None = None
    context: str = ""

    def line(self) -> str:
        """``ValueError: boom [raised on rank 1 in module 'faulty', microbatch 0, forward]``."""
        where = f"raised on rank {self.rank}"
        if self.module:
            where += f" in module {self.module!r}"
        if self.context:
            where += f", {self.context}"
        text = f"{self.kind}: {self.message}" if self.message else self.kind
        return f"{text} [{where}]"


def root_of(exc: BaseException, rank: int, module: str | None = None, context: str = "") -> RootCause:
    """The root cause ``exc`` already carries (a ``RemoteError`` passed on), else ``exc`` itself on ``rank``."""
    carried = getattr(exc, "root", None)
    if isinstance(carried, RootCause):
        return carried
    return RootCause(_type_name(exc), _first_line(exc), rank, module, context)


def summary(exc: BaseException) -> str:
    """One line: the carried root cause when there is one, else ``Type: first line of the message``."""
    carried = getattr(exc, "root", None)
    if isinstance(carried, RootCause):
        return carried.line()
    message = _first_line(exc)
    return f"{_type_name(exc)}: {message}" if message else _type_name(exc)


def write_error_file(message: str, details: str) -> None:
    """torch elastic's error file, when the launcher asked for one: ``message`` and a ``details`` traceback.

    torchrun prints ``details`` (``py_callstack``) under "Root Cause"; best effort, never raises.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": details, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError:
        pass


def _type_name(exc: BaseException) -> str:
    """As tracebacks print it: ``ValueError``, ``smp_compat.errors.RemoteError``."""
    kind = type(exc)
    module = kind.__module__
    return kind.__qualname__ if module in ("builtins", "__main__") else f"{module}.{kind.__qualname__}"


def _first_line(exc: BaseException) -> str:
    lines = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    head = lines[0] if lines else ""
    prefix = f"{_type_name(exc)}: "
    return head[len(prefix) :] if head.startswith(prefix) else ("" if head == _type_name(exc) else head)
