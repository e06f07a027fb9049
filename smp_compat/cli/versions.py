"""``smp-compat --version``: the versions in use, with a warning for each one outside the tested range.

The range is the one docs/versions.md tabulates (a test keeps the two equal): each end is a release CI or a
recorded one-time run passed on. A version outside it may well work; the warning says it was never run.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import sys

__all__ = ["TESTED", "installed", "outside_tested", "version_command"]

TESTED: dict[str, tuple[str, str]] = {
    "python": ("3.11", "3.11"),
    "torch": ("2.10", "2.15"),
    "transformers": ("4.40", "5.25"),
}
"""Per package, the oldest and newest release (major.minor) the test suite was run on."""


def installed() -> dict[str, str | None]:
    """The version of Python and of each package in ``TESTED`` (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in TESTED:
        if name != "python":
            try:
                found[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                found[name] = None
    return found


def _release(version: str, parts: int) -> tuple[int, ...]:
    """The first ``parts`` numbers of a version (``2.6.0+cu124`` -> ``(2, 6)``)."""
    numbers = [int(n) for n in re.findall(r"\d+", version.split("+")[0])[:parts]]
    return tuple(numbers + [0] * (parts - len(numbers)))


def outside_tested(name: str, version: str) -> bool:
    """Whether ``version`` of ``name`` lies outside ``TESTED[name]`` (compared on major.minor)."""
    low, high = TESTED[name]
    return not _release(low, 2) <= _release(version, 2) <= _release(high, 2)


def version_command() -> int:
    """Print smp-compat's version and those of Python, torch and transformers; warn on stderr for each one
    outside the tested range. Exit 0 either way: the warning informs, it does not forbid."""
    from smp_compat import __version__

    print(f"smp-compat {__version__}")
    for name, version in installed().items():
        low, high = TESTED[name]
        print(f"{name} {version or 'not installed'} (tested {low} - {high})")
        if version is not None and outside_tested(name, version):
            print(f"smp-compat: warning: {name} {version} is outside the tested range {low} - {high} "
                  "(docs/versions.md)", file=sys.stderr)  # fmt: skip
    return 0
