"""The quick tier's list (tests/quick_tier.py) points at tests that exist, in every test folder: a renamed file
or test would otherwise drop out of ``pytest -m quick`` without a word."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from quick_tier import QUICK, is_quick

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("entry", QUICK)
def test_each_entry_names_an_existing_file_and_test(entry: str) -> None:
    path, _, name = entry.partition("::")
    assert (TESTS / path).is_file(), f"tests/quick_tier.py: {path} does not exist"
    if name:
        function = name.split("[")[0]
        assert re.search(rf"^def {re.escape(function)}\w*\(", (TESTS / path).read_text(), re.M), (
            f"tests/quick_tier.py: no test {function}... in {path}")  # fmt: skip


def test_every_test_folder_has_a_quick_test() -> None:
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders == {entry.split("/")[0] for entry in QUICK}


def test_entries_match_files_and_node_id_prefixes_only() -> None:
    assert is_quick("tests/core/test_config.py::test_anything[1]")
    assert not is_quick("tests/core/test_config_other.py::test_anything")
    assert is_quick("tests/core/test_dp_fidelity.py::test_dp2_microbatches4_matches_single_process")
    assert not is_quick("tests/core/test_dp_fidelity.py::test_single_process_microbatches2_matches_reference")
