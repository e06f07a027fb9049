"""``smp-compat plan``: the partition of the first smp.step, computed in one process from a model factory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import smp_compat as smp
from smp_compat import cli
from smp_compat.cli.plan import InputSpec, load_factory, make_inputs, parse_inputs, plan_model
from smp_compat.errors import SMPConfigError
from smp_compat.globalstate import state
from smp_compat.partitioning import auto_plan, trace_modules

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WIDTH = 16


def mlp() -> nn.Module:
    """Eight equal Linear layers with activations in between: auto partition at pp = 2 cuts it in the middle."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


class Manual(nn.Module):
    """Placed by hand with smp.partition, which only records after smp.init with auto_partition off."""

    def __init__(self) -> None:
        super().__init__()
        with smp.partition(1):
            self.encoder = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def test_auto_plan_matches_the_partitioner_on_microbatch_zero() -> None:
    result = plan_model(mlp, parse_inputs("8x16"), {"pipeline_parallel_degree": 2, "microbatches": 4})
    model = mlp()
    reference = auto_plan(model, trace_modules(model, lambda: model(torch.zeros(2, WIDTH))), 2, 0.8)
    assert result.plan.assignment == reference.assignment
    assert set(result.plan.assignment.values()) == {0, 1}
    assert [r.parameter_bytes for r in result.ranks] == result.plan.param_bytes_per_rank(result.model)
    assert sum(r.parameters for r in result.ranks) == sum(p.numel() for p in result.model.parameters())
    assert sum(r.cost for r in result.ranks) == pytest.approx(1.0)
    assert result.ranks[0].cost == pytest.approx(result.ranks[1].cost, rel=0.25)  # balanced halves


def test_manual_plan_records_partition_blocks_without_processes() -> None:
    config = {"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0}
    result = plan_model(Manual, [InputSpec((4, WIDTH), torch.float32)], config)
    assert result.plan.method == "manual"
    assert result.plan.assignment == {"encoder": 1, "head": 0}
    assert [r.modules for r in result.ranks] == [1, 1]
    assert not state.initialized and state.cfg is None  # the planning state is gone again


def test_inputs_are_microbatch_zero_of_the_step_batch() -> None:
    ids, x = make_inputs(parse_inputs("8x5:int64:7,8x3:float16"), microbatches=4)
    assert ids.shape == (2, 5) and ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 7
    assert x.shape == (2, 3) and x.dtype == torch.float16
    with pytest.raises(SMPConfigError, match="does not split into microbatches=3"):
        make_inputs(parse_inputs("8x5"), microbatches=3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("8xq", "not dimensions joined by 'x'"), ("8:complex", "Unknown dtype 'complex'"), ("8:int64:-1", "HIGH"),
     ("0x4", "dimension below 1"), ("a:b:c:d", "SHAPE")],
)  # fmt: skip
def test_bad_input_specs_are_explained(spec: str, message: str) -> None:
    with pytest.raises(SMPConfigError, match=message):
        parse_inputs(spec)


def test_factory_errors_name_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(SMPConfigError, match="MODULE:FUNCTION"):
        load_factory("no_colon")
    with pytest.raises(SMPConfigError, match="does not exist"):
        load_factory(str(tmp_path / "missing.py") + ":make")
    (tmp_path / "factory.py").write_text("def make():\n    return 3\n")
    with pytest.raises(SMPConfigError, match="has no callable 'other'"):
        load_factory(str(tmp_path / "factory.py") + ":other")
    with pytest.raises(SMPConfigError, match="not an nn.Module"):
        plan_model(load_factory(str(tmp_path / "factory.py") + ":make"), parse_inputs("2x2"))


def test_a_factory_in_an_unmodified_smp_script_loads(tmp_path: Path) -> None:
    """An SMP script imports smdistributed.modelparallel.torch: plan puts the shim on the path, as run does."""
    from smp_compat import shim

    script = tmp_path / "smp_script.py"
    script.write_text("import smdistributed.modelparallel.torch as smp\nimport torch\n\n"
                      "def make():\n    return torch.nn.Linear(2, 2)\n")  # fmt: skip
    try:
        assert isinstance(load_factory(f"{script}:make")(), nn.Linear)  # was ModuleNotFoundError
    finally:
        shim.uninstall()


def test_command_prints_the_tables(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [str(Path(__file__).parent), *sys.path])
    config = '{"partitions": 2, "microbatches": 2}'
    code = cli.main(["plan", "test_plan:mlp", "--input", "8x16", "--config", config])
    out = capsys.readouterr().out
    assert code == 0
    assert "Partition assignments (auto, pp=2)" in out and "Per pipeline rank" in out
    assert "Sequential: pipeline_parallel_degree 2, microbatches 2, auto partition" in out


def test_command_json_on_the_mnist_example(capsys: pytest.CaptureFixture[str]) -> None:
    distribution = json.dumps({"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "partitions": 2, "microbatches": 4}}}, "mpi": {"enabled": True, "processes_per_host": 2}})  # fmt: skip
    code = cli.main(["plan", f"{EXAMPLES / 'mnist_cnn.py'}:make_model", "--input", "32x1x28x28:float32",
                     "--config", distribution, "--json"])  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(data["plan"]["assignment"]) == {"net1.conv1", "net1.conv2", "net2.fc1", "net2.fc2"}
    assert data["plan"]["assignment"]["net1.conv1"] == 0 and data["plan"]["assignment"]["net2.fc2"] == 1
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["config"]["microbatches"] == 4


def test_invalid_config_is_reported_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["plan", f"{EXAMPLES / 'mnist_cnn.py'}:make_model", "--input", "4x1x28x28", "--config",
                     '{"microbatchez": 2}'])  # fmt: skip
    assert code == 2
    assert 'unknown key "microbatchez"' in capsys.readouterr().err


def test_config_is_read_as_run_reads_it(capsys: pytest.CaptureFixture[str]) -> None:
    """One reader for --config (smp-compat run's): its mpi section checked, its errors worded the same."""
    factory = f"{EXAMPLES / 'mnist_cnn.py'}:make_model"
    bad_mpi = json.dumps({"smdistributed": {"modelparallel": {"parameters": {}}}, "mpi": {"processes_per_host": 0}})
    for config, message in ((bad_mpi, '"mpi"."processes_per_host" must be a positive int'),
                            ("no/such/file.json", "neither a JSON object")):  # fmt: skip
        assert cli.main(["plan", factory, "--input", "4x1x28x28", "--config", config]) == 2
        assert message in capsys.readouterr().err
