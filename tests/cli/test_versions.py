"""``smp-compat --version`` prints the versions in use and warns for one outside the tested range; the range
in the code is the one docs/versions.md tabulates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from smp_compat import cli
from smp_compat.cli import versions

DOC = Path(__file__).resolve().parents[2] / "docs" / "versions.md"


def test_version_prints_python_torch_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smp-compat ") and f"torch {importlib.metadata.version('torch')} (tested " in out
    assert "python " in out and "transformers " in out


def test_version_warns_outside_the_tested_range(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(versions, "installed", lambda: {"python": "3.11.9", "torch": "2.6.0+cpu",
                                                        "transformers": None})  # fmt: skip
    assert cli.main(["--version"]) == 0
    captured = capsys.readouterr()
    assert "transformers not installed" in captured.out
    assert "warning: torch 2.6.0+cpu is outside the tested range" in captured.err
    assert "python" not in captured.err and "transformers" not in captured.err


@pytest.mark.parametrize(("name", "version", "outside"), [
    ("torch", "2.13.0+cu128", False), ("torch", "2.10.0", False), ("torch", "2.9.1", True), ("torch", "2.15.1", False),
    ("torch", "2.16.0", True), ("transformers", "4.40.2", False), ("transformers", "4.39.3", True),
    ("transformers", "5.25.0", False), ("transformers", "5.26.0.dev0", True), ("python", "3.12.1", True),
])  # fmt: skip
def test_outside_tested_compares_major_minor(name: str, version: str, outside: bool) -> None:
    assert versions.outside_tested(name, version) is outside


def test_docs_table_is_the_tested_range() -> None:
    """Rows ``| name | oldest | its date | newest | its date | ...``: the ends agree with TESTED (major.minor)."""
    rows = {m[0]: (m[1], m[2]) for m in re.findall(
        r"^\| (Python|torch|transformers) \| ([\d.]+) \| [^|]+ \| ([\d.]+) \|", DOC.read_text(), re.M)}  # fmt: skip
    for name, (low, high) in versions.TESTED.items():
        doc_low, doc_high = rows["Python" if name == "python" else name]
        assert doc_low.startswith(low) and doc_high.startswith(high), (name, doc_low, doc_high)


def test_declared_floors_are_the_tested_ones() -> None:
    """pyproject.toml's torch and transformers floors and README's are the tested ones; the import-time check's
    floor (the APIs smp_compat calls exist) is no higher."""
    from smp_compat.host import torch_floor

    root = DOC.parents[1]
    pyproject, readme = (root / "pyproject.toml").read_text(), (root / "README.md").read_text()
    torch_low, hf_low = versions.TESTED["torch"][0], versions.TESTED["transformers"][0]
    assert f'"torch>={torch_low}"' in pyproject and f'"transformers>={hf_low}"' in pyproject
    assert f"torch >= {torch_low}" in readme
    assert versions._release(torch_floor.TORCH_FLOOR, 2) <= versions._release(torch_low, 2)
