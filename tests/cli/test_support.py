"""The support registry agrees with the package: names, statuses, config keys, and the generated docs page."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import smp_compat
from smp_compat.cli import support, support_docs
from smp_compat.config import NOT_ACTED_ON, SMP_KEYS, UNSUPPORTED
from smp_compat.errors import SMPUnsupportedError
from smp_compat.cli.support import API, CONFIG, METHODS, Status

ROOT = Path(__file__).resolve().parents[2]
_MODULE_NAMES = {"amp", "nn", "nn.huggingface", "optimizers", "patches"}  # SMP names that are submodules, not functions or classes
_MISSING = object()


def _resolve(name: str) -> Any:
    value: Any = smp_compat
    for part in name.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


@pytest.mark.parametrize("name", sorted(n for n, e in API.items() if e.status is not Status.UNSUPPORTED))
def test_supported_api_exists(name: str) -> None:
    value = _resolve(name)
    assert value is not _MISSING, f"support.py marks smp.{name} {API[name].status.value}, but smp_compat lacks it"
    if name not in _MODULE_NAMES:
        assert not isinstance(value, types.ModuleType), (
            f"smp_compat.{name} is a module, but SMP's smp.{name} is a function or class (a submodule shadows it)"
        )


@pytest.mark.parametrize("name", sorted(n for n, e in API.items() if e.status is Status.UNSUPPORTED))
def test_unsupported_api_is_absent(name: str) -> None:
    value = _resolve(name)
    assert value is _MISSING, f"smp_compat now has smp.{name}: update its status in smp_compat/cli/support.py"


def test_every_public_name_is_registered() -> None:
    missing = sorted(set(smp_compat.__all__) - set(API))
    assert not missing, f"public smp_compat names missing from smp_compat/cli/support.py: {missing}"


def test_group_lookup_and_longest_prefix() -> None:
    entry, covered = support.lookup_api(["CommGroup", "DP_GROUP"])
    assert (entry.name, covered) == ("CommGroup", 1)
    entry, covered = support.lookup_api(["nn", "NotAModule"])
    assert (entry.name, entry.group, entry.status) == ("nn", True, Status.SUPPORTED)
    entry, covered = support.lookup_api(["nn", "huggingface", "gpt2", "translate_state_dict_to_hf_gpt2"])
    assert entry.name == "nn.huggingface" and covered == 2
    assert support.lookup_api(["no_such_api"]) is None


def test_unsupported_entries_say_what_to_do() -> None:
    for entry in [*API.values(), *METHODS.values(), *CONFIG.values()]:
        if entry.status is not Status.SUPPORTED:
            assert entry.note and entry.action, f"{entry.kind} {entry.name} needs a note and an action"


# ---------------------------------------------------------------- members


@pytest.fixture
def wrapped() -> tuple[Any, Any]:
    smp_compat.init({})
    model = smp_compat.DistributedModel(nn.Linear(2, 2))
    optimizer = smp_compat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, optimizer


def _members(section: str) -> dict[str, support.Entry]:
    return {name.split(".", 1)[1]: e for name, e in METHODS.items() if e.section == section}


def test_distributed_model_members(wrapped: tuple[Any, Any]) -> None:
    model, _ = wrapped
    for name, entry in _members("DistributedModel").items():
        assert hasattr(model, name), f"DistributedModel.{name} is registered as {entry.status.value} but missing"
        if entry.status is Status.UNSUPPORTED:
            with pytest.raises(SMPUnsupportedError):
                getattr(model, name)()


def test_optimizer_members(wrapped: tuple[Any, Any]) -> None:
    """fp32: the patched torch optimizer; members marked "only with fp16 or bf16" come with the wrapper."""
    _, optimizer = wrapped
    half_only = {n for n, e in _members("DistributedOptimizer").items() if "only with fp16 or bf16" in e.note}
    assert half_only, "the registry should name the members of SMP's fp16 wrapper"
    sdp_only = {n for n, e in _members("DistributedOptimizer").items() if "only with sharded data parallelism" in e.note}
    for name, entry in _members("DistributedOptimizer").items():
        present = hasattr(optimizer, name)
        expected = entry.status is not Status.UNSUPPORTED and name not in half_only | sdp_only
        assert present == expected, f"optimizer.{name}: registered {entry.status.value}, hasattr {present} (fp32)"
    smp_compat.reset()
    smp_compat.init({"bf16": True})
    with smp_compat.model_creation(dtype=torch.bfloat16):
        module = nn.Linear(2, 2)
    model = smp_compat.DistributedModel(module)
    wrapper = smp_compat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for name in half_only:
        assert hasattr(wrapper, name), f"optimizer.{name} missing with bf16 on"


def test_step_output_members() -> None:
    output = smp_compat.StepOutput([torch.ones(1), torch.ones(1)])
    for name, entry in _members("StepOutput").items():
        assert hasattr(output, name) == (entry.status is not Status.UNSUPPORTED), name


# ---------------------------------------------------------------- config keys


def test_config_registry_is_derived_from_config() -> None:
    assert set(CONFIG) == set(SMP_KEYS) | set(support.CONFIG_ALIASES)
    for key in SMP_KEYS:
        expected = (
            Status.UNSUPPORTED if key in UNSUPPORTED else Status.PARTIAL if key in NOT_ACTED_ON else Status.SUPPORTED
        )
        assert CONFIG[key].status is expected, key
    assert CONFIG["partitions"].status is CONFIG["pipeline_parallel_degree"].status


def test_config_value_status_depends_on_the_value() -> None:
    for missing in sorted(UNSUPPORTED):  # empty since tensor and sharded data parallelism landed
        default = support.config_default(missing)
        assert support.config_value_status(missing, default)[0] is Status.SUPPORTED
        assert support.config_value_status(missing, default + 1)[0] is Status.UNSUPPORTED
        assert support.config_value_status(missing, None, known=False)[0] is Status.PARTIAL
    ignored = next(iter(sorted(NOT_ACTED_ON - {"_sharded_data_parallelism_config"})))
    assert support.config_value_status(ignored, support.config_default(ignored))[0] is Status.SUPPORTED
    assert support.config_value_status("microbatches", 8) == (Status.SUPPORTED, "")
    with pytest.raises(KeyError):
        support.config_value_status("no_such_key", 1)
    assert support.suggest_key("memory_weigth") == ["memory_weight"]


# ---------------------------------------------------------------- docs


def test_docs_page_is_generated_from_the_registry() -> None:
    page = (ROOT / "docs" / "api_support.md").read_text(encoding="utf-8")
    assert page == support_docs.markdown(), (
        "docs/api_support.md is stale: run `python -m smp_compat.cli.support --markdown > docs/api_support.md`"
    )


def test_markdown_lists_every_name_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert support.main(["--markdown"]) == 0
    page = capsys.readouterr().out.split("# SMP v2 API support")[0]  # v2's tables: tests/v2/test_v2_check.py
    for name in API:
        assert page.count(f"| `smp.{name}`") == 1, name
    for key in CONFIG:
        assert page.count(f"| `{key}` |") == 1, key


def test_troubleshooting_covers_every_error_and_timeout() -> None:
    from smp_compat import errors
    from smp_compat.shim import ShimConflictError

    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    for name in [*errors.__all__, ShimConflictError.__name__]:
        assert f"### `{name}`" in page or name == "SMPError", f"docs/troubleshooting.md has no section for {name}"
    for text in ("SMP_PIPELINE_TIMEOUT_S", "SMP_PG_TIMEOUT_S", "code 17", "smp_compat: stopping rank"):
        assert text in page


def test_docs_index_links_every_page() -> None:
    import re

    docs = ROOT / "docs"
    index = (docs / "index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)", index))
    pages = {p.name for p in docs.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"docs/index.md does not link {sorted(pages - linked)}"
    assert {name for name in linked if not (docs / name).is_file()} == set()
