"""`smp-compat check` on SMP v2 scripts and configs, and the v2 registry held against the package."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import pytest

from smp_compat.cli.check import check_json, check_source
from smp_compat.cli.support import Status
from smp_compat.cli.support_v2 import API_V2, CONFIG_V2
from smp_compat.v2.config import V2_KEYS

SCRIPT = '''
import torch
import torch.distributed as dist
import torch.sagemaker as tsm
from torch.sagemaker.delayed_param import DelayedParamIniter
from torch.sagemaker.checkpoint.utils import SORT_BY_LAST_INT
import torch.sagemaker.utils.utils as tsm_utils

tsm.init({"hybrid_shard_degree": 2, "tensor_paralel_degree": 2, "context_parallel_degree": 4})
tsm.state.tensor_parallel_degree = 1
tsm.state.no_such_attribute
tsm.transform(model)
estimator_distribution = {
    "torch_distributed": {"enabled": True},
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"hybrid_shard_degree": "4"}}},
}
'''


def _findings(report):
    return {(f.kind, f.name): f for f in report.findings}


def test_a_v2_script_is_read_as_smp_v2() -> None:
    found = _findings(check_source(SCRIPT))
    assert found["api", "tsm.init"].status == "supported"
    assert found["api", "tsm.delayed_param.DelayedParamIniter"].status == "supported"
    assert found["api", "tsm.checkpoint.utils.SORT_BY_LAST_INT"].status == "supported"
    assert found["api", "tsm.utils.utils"].status == "supported"
    assert found["api", "tsm.state.tensor_parallel_degree"].status == "supported"
    assert found["api", "tsm.transform"].status == "partial"
    assert found["api", "tsm.state.no_such_attribute"].status == "error"
    assert found["config", "hybrid_shard_degree"].status == "error"  # "4" in the distribution: a string
    assert "Did you mean 'tensor_parallel_degree'?" in found["config", "tensor_paralel_degree"].action
    cp = found["config", "context_parallel_degree"]
    assert cp.status == "error" and "cannot exceed hybrid_shard_degree" in cp.note  # the rule, on a literal dict


def test_a_v2_json_config(tmp_path: Path) -> None:
    path = tmp_path / "v2.json"
    params = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "placement_strategy": "cluster",
              "expert_parallel_degree": 1, "sm_activation_offloading": False}  # fmt: skip
    path.write_text(json.dumps({"torch_distributed": {"enabled": True},
                                "smdistributed": {"modelparallel": {"enabled": True, "parameters": params}}}))  # fmt: skip
    found = _findings(check_json(path))
    assert {name for _, name in found} == set(params)
    assert all(f.status in ("supported", "partial") for f in found.values()), found
    assert found["config", "expert_parallel_degree"].status == "supported"  # its default is fine


def test_docs_list_every_v2_name_and_key_once() -> None:
    from smp_compat.cli.support_docs import markdown

    page = markdown().split("# SMP v2 API support")[1]
    for name, entry in API_V2.items():
        assert page.count(f"| `tsm.{name}`") == (0 if entry.kind == "module" else 1), name
    for key in CONFIG_V2:
        assert page.count(f"| `{key}` |") == 1, key


def test_registry_lists_the_nine_keys() -> None:
    assert set(CONFIG_V2) == V2_KEYS
    assert all(entry.meaning for entry in CONFIG_V2.values())


def _resolves(name: str) -> bool:
    """``torch.sagemaker.<name>``: the longest importable module prefix, then attributes."""
    import smp_compat.v2  # noqa: F401 - installs the finder

    parts = name.split(".")
    for length in range(len(parts), -1, -1):
        try:
            value = importlib.import_module(".".join(["torch.sagemaker", *parts[:length]]))
        except ModuleNotFoundError:
            continue
        try:
            for part in parts[length:]:
                value = getattr(value, part)
        except AttributeError:
            return False
        return True
    return False


def _elsewhere(name: str) -> bool:
    """Names in a folder another helper's branch brings (present on main once every branch is merged)."""
    head = name.split(".")[0]
    return API_V2.get(head) is not None and API_V2[head].kind == "module" and importlib.util.find_spec(
        f"smp_compat.v2.{head}") is None  # fmt: skip


@pytest.mark.parametrize("name", [n for n in API_V2 if not n.startswith("state")])
def test_registry_names_resolve_through_torch_sagemaker(name: str) -> None:
    """Supported and partial names import through torch.sagemaker; unsupported ones do not."""
    entry = API_V2[name]
    if entry.status is not Status.UNSUPPORTED and _elsewhere(name):
        pytest.skip(f"smp_compat.v2.{name.split('.')[0]} comes with another helper's branch")
    assert _resolves(name) == (entry.status is not Status.UNSUPPORTED), f"{name}: {entry.status}"


@pytest.mark.parametrize("name", [n for n in API_V2 if n.startswith("state.")])
def test_registry_state_attributes_exist(name: str) -> None:
    from smp_compat.v2.state import State

    from smp_compat.v2.state import Ranker

    owner: type = State
    for part in name.split(".")[1:]:
        assert hasattr(owner, part), name
        owner = Ranker if part == "ranker" else owner
