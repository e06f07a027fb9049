"""Options that take JSON inline or as a file (``--config``, ``--hyperparameters``): one reader, one error."""

from __future__ import annotations

from pathlib import Path

from smp_compat.errors import SMPConfigError

__all__ = ["json_text"]


def json_text(value: str, option: str, example: str) -> tuple[str, str]:
    """The JSON text of ``option``'s value and where it came from, for error messages.

    Inline when it starts with ``{`` (or ``[``, so a list gets the "must be an object" error, not "no such
    file"); otherwise the path of a readable file. ``example`` is an inline value shown in the error.
    """
    if value.lstrip().startswith(("{", "[")):
        return value, option
    path = Path(value)
    if not path.is_file():
        raise SMPConfigError(
            f"{option} {value!r} is neither a JSON object (it does not start with '{{') nor an existing file. "
            f"Pass inline JSON such as '{example}' or the path of a JSON file."
        )
    try:
        return path.read_text(encoding="utf-8"), f"{option} file {value!r}"
    except (OSError, UnicodeDecodeError) as exc:
        raise SMPConfigError(f"Cannot read {option} file {value!r}: {exc}. Pass a readable JSON file.") from None
