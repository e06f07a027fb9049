"""One row of docs/versions.md's sweep table from a pytest JUnit report (used by .ci/sweep).

The row names what ran (date, torch, transformers, Python, tier, commit), what came of it (passed / failed /
skipped, minutes) and the first failures, so that a release's row says why it failed without the log.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import platform
import xml.etree.ElementTree as ET
from pathlib import Path

HEADER = ("| Date | torch | transformers | Python | Tier | Commit | Passed | Failed | Skipped | Time "
          "| First failures |\n|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
FIRST = 3  # failures named in a row
WIDTH = 140  # characters kept of each failure's message


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _failures(suite: ET.Element) -> list[str]:
    """``test id: first line of the message`` for each failed or erroring test case, in run order."""
    found = []
    for case in suite.iter("testcase"):
        for outcome in ("failure", "error"):
            element = case.find(outcome)
            if element is not None:
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (element.get("message") or element.text or outcome).strip().splitlines()
                found.append(f"`{name}`: {message[0][:WIDTH] if message else outcome}")
                break
    return found


def counts(junit: Path) -> tuple[int, int, int, list[str]]:
    """(passed, failed, skipped, first failures) of a JUnit report; errors count as failures."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = failed = skipped = 0
    failures: list[str] = []
    for suite in suites:
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
        failures += _failures(suite)
    return total - failed - skipped, failed, skipped, failures


def row(junit: Path, import_error: Path, seconds: int, tier: str, commit: str) -> str:
    """The markdown row; a torch that ``import smp_compat`` refuses gets its message instead of counts."""
    cells = [datetime.date.today().isoformat(), _version("torch"), _version("transformers"),
             platform.python_version(), tier, commit]  # fmt: skip
    if junit.exists():
        passed, failed, skipped, failures = counts(junit)
        first = "; ".join(failures[:FIRST]) + (f"; ... ({len(failures)} in all)" if len(failures) > FIRST else "")
        cells += [str(passed), str(failed), str(skipped), f"{seconds // 60} min {seconds % 60} s", first or "none"]
    else:
        text = import_error.read_text().strip().splitlines() if import_error.exists() else []
        reason = text[-1][:400] if text else "no test report"
        cells += ["-", "-", "-", f"{seconds} s", f"`import smp_compat` fails: {reason}"]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--junit", type=Path, required=True)
    parser.add_argument("--import-error", type=Path, required=True)
    parser.add_argument("--seconds", type=int, required=True)
    parser.add_argument("--tier", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--header", action="store_true", help="print the table's header first")
    args = parser.parse_args()
    if args.header:
        print(HEADER)
    print(row(args.junit, args.import_error, args.seconds, args.tier, args.commit))


if __name__ == "__main__":
    main()
