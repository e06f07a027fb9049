"""The porting examples run from their documented commands: the MNIST CNN trains like plain PyTorch, the
timeline demo records a pp = 2, microbatches = 4 step that ``smp-compat timeline`` draws.

Launch helpers (hard timeout, clean environment, free port) come from tests/launching.py.
"""

from __future__ import annotations

import importlib.util
import json
import types
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from smp_compat import cli
from smp_compat.cli.timeline import build_picture, load_trace
from launching import ROOT, clean_env, free_port, run_all, smp_compat_command

EXAMPLES = ROOT / "examples"
MNIST = EXAMPLES / "mnist_cnn.py"
DEMO = EXAMPLES / "timeline_demo.py"
MNIST_ARGS = ["--epochs", "1", "--train-samples", "128", "--test-samples", "32", "--batch-size", "16"]
DISTRIBUTION = {  # what a SageMaker estimator's distribution= says; processes_per_host is the process count
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "partitions": 2, "microbatches": 4, "placement_strategy": "spread", "ddp": True}}},
    "mpi": {"enabled": True, "processes_per_host": 2},
}  # fmt: skip
DOCUMENTED = (
    "smp-compat run --nproc-per-node 2 examples/timeline_demo.py --trace out.json && "
    "smp-compat timeline out.json --svg docs/img/timeline.svg"
)


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"porting_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mnist_reference(example: types.ModuleType) -> dict[str, Any]:
    """The same model, data and optimizer in one plain PyTorch process, on the global batches."""
    model = example.make_model()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    images, labels = example.make_data(128, seed=1)
    losses = []
    for start in range(0, 128, 16):
        optimizer.zero_grad()
        loss = F.nll_loss(model(images[start : start + 16]), labels[start : start + 16])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    test_x, test_y = example.make_data(32, seed=2)
    model.eval()
    with torch.no_grad():
        test_loss = F.nll_loss(model(test_x), test_y, reduction="sum").item() / 32
    return {"losses": losses, "test_loss": test_loss, "params": model.state_dict()}


def _check_mnist(result: dict[str, Any], reference: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    assert result["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5)
    assert result["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_mnist_under_smp_compat_run_with_a_sagemaker_config(tmp_path: Path) -> None:
    """Two pipeline stages from the distribution dict alone (processes_per_host 2 -> two processes)."""
    out = tmp_path / "mnist.pt"
    cmd = [*smp_compat_command(), "run", "--master-port", str(free_port()), "--config", json.dumps(DISTRIBUTION),
           str(MNIST), *MNIST_ARGS, "--out", str(out)]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    result = torch.load(out)
    assert (result["pp_size"], result["dp_size"]) == (2, 1)
    assert result["smp_import"] == "smdistributed.modelparallel.torch"  # the unmodified import, through the shim
    _check_mnist(result, _mnist_reference(_load(MNIST)))


def test_mnist_dry_run_prints_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--dry-run", "--config", json.dumps(DISTRIBUTION), str(MNIST)]) == 0
    out = capsys.readouterr().out
    assert "World size 2 = 1 node(s) x 2 process(es) per node; pipeline_parallel_degree 2" in out
    assert "placement_strategy 'spread'" in out
    assert '"partitions": 2' in out and "SM_FRAMEWORK_PARAMS=" in out and "torch.distributed.run" in out


def test_mnist_in_a_world_of_one(tmp_path: Path) -> None:
    """`python examples/mnist_cnn.py`: no launcher, one stage (run in this process)."""
    example = _load(MNIST)
    out = tmp_path / "mnist.pt"
    example.main([*MNIST_ARGS, "--out", str(out)])
    result = torch.load(out)
    assert (result["pp_size"], result["dp_size"], result["smp_import"]) == (1, 1, "smp_compat")
    _check_mnist(result, _mnist_reference(example))


def test_timeline_demo_and_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The documented command, with a smaller model: a recorded pp = 2, microbatches = 4 step, drawn."""
    trace = tmp_path / "out.json"
    small = ["--width", "64", "--layers", "2", "--batch", "32", "--warmup", "1", "--steps", "1"]
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", "2", "--master-port", str(free_port()), str(DEMO),
           "--trace", str(trace), *small]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    events, other = load_trace(trace)
    assert (other["pp"], other["microbatches"], other["world_size"]) == (2, 4, 2)
    picture = build_picture(events, other)
    assert [lane.rank for lane in picture.lanes] == [0, 1]
    for lane in picture.lanes:
        phases = {(bar.category, bar.microbatch) for bar in lane.bars if bar.category != "idle"}
        assert phases == {(phase, mb) for phase in ("forward", "backward") for mb in range(4)}, lane.rank
        assert 0.0 <= lane.fraction("idle") < 1.0
    svg = tmp_path / "timeline.svg"
    assert cli.main(["timeline", str(trace), "--svg", str(svg)]) == 0
    assert "ideal bubble" in capsys.readouterr().out
    ET.fromstring(svg.read_text())


def test_docs_show_the_documented_commands() -> None:
    porting = (ROOT / "docs" / "porting.md").read_text(encoding="utf-8")
    assert DOCUMENTED in porting
    assert "smp-compat run --nproc-per-node 2 examples/mnist_cnn.py" in porting
    assert "img/timeline.svg" in porting and (ROOT / "docs" / "img" / "timeline.svg").is_file()
    ET.fromstring((ROOT / "docs" / "img" / "timeline.svg").read_text(encoding="utf-8"))


@pytest.mark.parametrize("processes", [2, 4])
def test_mnist_with_grad_scaler_autocast_and_smp_save_load(tmp_path: Path, processes: int) -> None:
    """AWS's MNIST CI shape: GradScaler + autocast, partial and full smp.save, smp.load, allgather of the loss."""
    out = tmp_path / "mnist.pt"
    cmd = [*smp_compat_command(), "run", "--nproc-per-node", str(processes), "--master-port", str(free_port()),
           "--config", json.dumps(DISTRIBUTION), str(MNIST), *MNIST_ARGS, "--amp", "--save-dir", str(tmp_path),
           "--out", str(out)]  # fmt: skip
    run_all([(cmd, clean_env())], tmp_path)
    result = torch.load(out)
    assert result["pp_size"] == 2 and result["dp_size"] == processes // 2
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert (tmp_path / "model_full.pt").is_file() and (tmp_path / "model_partial.pt_1_0.pt").is_file()
