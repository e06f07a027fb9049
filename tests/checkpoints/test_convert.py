"""``smp-compat checkpoint``: merge partial checkpoints (ours and SMP's layouts) and split plain state dicts."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_compat as smp
from models import causal_mask, lm_loss, make_batches, make_model
from smp_compat.checkpoints import convert, cutting
from smp_compat.cli import main
from smp_compat.errors import CheckpointError
from smp_compat.testing import run_ranks

__all__: list[str] = []

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # import torch._dynamo once, before forking

PP2 = {"pipeline_parallel_degree": 2, "microbatches": 1, "auto_partition": False, "default_partition": 0}



# ---------------------------------------------------------------------------- our own checkpoints (pp = 2)


def _build() -> tuple[Any, Any]:
    model = smp.DistributedModel(make_model())
    for i, block in enumerate(model.module.blocks):
        smp.set_partition(block, 0 if i < 2 else 1)
    smp.set_partition(model.module.ln_f, 1)
    return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))


def _train_and_save(directory: str) -> dict[str, Any]:
    smp.init(PP2)
    model, opt = _build()
    mask = causal_mask(8)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(x, attention_mask=mask), y)
        model.backward(loss)
        return loss

    for x, y in make_batches(2, 4):
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    smp.save_checkpoint(directory, "trained", model=model, optimizer=opt)
    return {"full": model.state_dict(gather_to_rank0=False), "opt": opt.state_dict()}


def _resume(directory: str, tag: str) -> dict[str, Any]:
    from smp_compat.checkpoints import state_dicts

    merges = []
    real = state_dicts.merge_model_parts
    state_dicts.merge_model_parts = lambda p: (merges.append(1), real(p))[1]  # type: ignore[assignment]
    smp.init(PP2)
    model, _ = _build()
    smp.resume_from_checkpoint(directory, tag, load_optimizer=False)

    @smp.step
    def look(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x, attention_mask=causal_mask(8))

    with torch.no_grad():
        look(model, make_batches(1, 2)[0][0])
    return {"params": {n: p.detach().clone() for n, p in model.local_named_parameters()}, "merged": bool(merges)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("ckpt")
    return directory, run_ranks(_train_and_save, 2, str(directory), timeout=60)[0]


def test_merge_gives_the_full_state_dict_and_optimizer(trained: tuple[Path, dict], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    directory, result = trained
    out, opt_out = tmp_path / "model.pt", tmp_path / "optim.pt"
    assert main(["checkpoint", "merge", str(directory), "-o", str(out), "--optimizer-output", str(opt_out)]) == 0
    assert "2 pipeline part(s)" in capsys.readouterr().out
    merged = torch.load(out, weights_only=True)
    assert set(merged) == set(result["full"])
    for name, value in result["full"].items():
        assert torch.equal(merged[name], value), name
    make_model(seed=3).load_state_dict(merged)  # a plain PyTorch state dict
    optim = torch.load(opt_out, weights_only=True)
    assert optim["param_groups"][0]["params"] == result["opt"]["param_groups"][0]["params"]
    assert sorted(optim["state"]) == sorted(result["opt"]["state"])
    for i, s in result["opt"]["state"].items():
        for key, value in s.items():
            assert torch.equal(optim["state"][i][key], value)


def test_info_describes_the_checkpoint(trained: tuple[Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    directory, _ = trained
    assert main(["checkpoint", "info", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "model_<pp>_<tp>.pt" in out and "pipeline parts: 2" in out and "optimizer pp=1 tp=0" in out
    assert "'pipeline_parallel_degree': 2" in out and "newest (oldest first): trained_partial" in out


@pytest.mark.parametrize("with_plan", [True, False])
def test_split_round_trips_into_a_resumable_checkpoint(trained: tuple[Path, dict], tmp_path: Path,
                                                       with_plan: bool) -> None:  # fmt: skip
    directory, result = trained
    plain = tmp_path / "plain.pt"
    torch.save(result["full"], plain)
    out = tmp_path / "converted"
    args = ["checkpoint", "split", str(plain), "--pp", "2", "-o", str(out), "--tag", "conv"]
    assert main(args + (["--plan", str(directory / "trained_partial")] if with_plan else [])) == 0
    resumed = run_ranks(_resume, 2, str(out), "conv", timeout=60)
    for r in resumed:
        assert r["merged"] is not with_plan  # the job's own plan: each rank loads its own part directly
        for name, value in r["params"].items():
            assert torch.equal(value, result["full"][name])
    again = tmp_path / "again.pt"
    assert main(["checkpoint", "merge", str(out), "--tag", "conv", "-o", str(again)]) == 0
    merged = torch.load(again, weights_only=True)
    assert all(torch.equal(merged[k], v) for k, v in result["full"].items())


# ---------------------------------------------------------------------------- SMP's own file layouts (forged)


def _smp_part(keys: list[str], seed: int, prefix: str = "module.") -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    part: dict[str, Any] = {f"{prefix}{k}": torch.randn(2, 2, generator=g) for k in keys}
    part["_smp_is_partial"] = True
    part["_smp_load_info"] = {"tensor_parallel_degree": 1, "pipeline_parallel_degree": 2, "partition_info": {}}
    return part


def _expected() -> dict[str, torch.Tensor]:
    a, b = _smp_part(["a.weight"], 0), _smp_part(["b.weight", "b.bias"], 1)
    return {k[len("module."):]: v for k, v in {**a, **b}.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(
    ("names", "wrap"),
    [
        (["ckpt.pt_0", "ckpt.pt_1"], True),  # <= 1.9: {f}_{mp_rank}, the usual {"model": ...} bundle
        (["ckpt.pt_0_0", "ckpt.pt_1_0"], False),  # 1.6 - 1.9 with TP naming
        (["ckpt.pt_0_0.pt", "ckpt.pt_1_0.pt"], True),  # >= 1.10
        (["ckpt.pt_0_0_0.pt", "ckpt.pt_1_0_0.pt", "ckpt.pt_0_0_1.pt", "ckpt.pt_1_0_1.pt"], False),  # v3
    ],
)
def test_merge_reads_smp_save_layouts(tmp_path: Path, names: list[str], wrap: bool) -> None:
    for name in names:
        pp = int(name.split("_")[1].split(".")[0])
        part = _smp_part(["a.weight"] if pp == 0 else ["b.weight", "b.bias"], pp)
        torch.save({"model": part, "step": 3} if wrap else part, tmp_path / name)
    layout = convert.detect_layout(tmp_path / "ckpt.pt")
    assert layout.kind == "save" and layout.pp_size == 2
    merged = convert.merge_model(layout)
    assert list(merged) == ["a.weight", "b.weight", "b.bias"]
    for key, value in _expected().items():
        assert torch.equal(merged[key], value)


def test_merge_reads_an_smp_checkpoint_folder(tmp_path: Path) -> None:
    folder = tmp_path / "step_5_partial"
    folder.mkdir()
    torch.save(_smp_part(["a.weight"], 0), folder / "model_0_0.pt")
    torch.save(_smp_part(["b.weight", "b.bias"], 1), folder / "model_1_0.pt")
    (tmp_path / "newest").write_text("step_5_partial\n")
    out = tmp_path / "merged.pt"
    assert main(["checkpoint", "merge", str(tmp_path), "-o", str(out), "--strip-prefix", "none"]) == 0
    assert sorted(torch.load(out, weights_only=True)) == ["module.a.weight", "module.b.bias", "module.b.weight"]
    assert main(["checkpoint", "merge", str(tmp_path), "-o", str(out)]) == 0
    merged = torch.load(out, weights_only=True)
    assert all(torch.equal(merged[k], v) for k, v in _expected().items())


def test_smp_classes_load_as_placeholders_only_when_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = types.ModuleType("smdistributed.modelparallel.torch.fake")

    class Scaler:
        def __init__(self) -> None:
            self.scale = 2.0**16

    Scaler.__module__ = fake.__name__
    Scaler.__qualname__ = "Scaler"
    fake.Scaler = Scaler  # type: ignore[attr-defined]
    names = ["smdistributed", "smdistributed.modelparallel", "smdistributed.modelparallel.torch", fake.__name__]
    for name in names[:-1]:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[fake.__name__] = fake
    try:
        for pp in (0, 1):
            part = {"model": _smp_part(["a.weight"] if pp == 0 else ["b.weight", "b.bias"], pp), "scaler": Scaler()}
            torch.save(part, tmp_path / f"ck_{pp}_0.pt")
    finally:
        for name in names:
            sys.modules.pop(name, None)
    out = tmp_path / "m.pt"
    assert main(["checkpoint", "merge", str(tmp_path / "ck"), "-o", str(out)]) == 2
    assert "--unsafe" in capsys.readouterr().err
    assert main(["checkpoint", "merge", str(tmp_path / "ck"), "-o", str(out), "--unsafe"]) == 0
    assert sorted(torch.load(out, weights_only=True)) == ["a.weight", "b.bias", "b.weight"]
    bundle = convert.load_file(tmp_path / "ck_0_0.pt", unsafe=True)
    assert isinstance(bundle["scaler"], convert.SMPObject) and "fake.Scaler" in repr(bundle["scaler"])


def test_layout_errors_are_explained(tmp_path: Path) -> None:
    torch.save(_smp_part(["a.weight"], 0), tmp_path / "tp_0_0.pt")
    torch.save(_smp_part(["a.weight"], 0), tmp_path / "tp_0_1.pt")
    with pytest.raises(CheckpointError, match=r"without the record of which entries are shards"):
        convert.merge_model(convert.detect_layout(tmp_path / "tp"))  # SMP's tp parts: which dim is unknown
    torch.save(_smp_part(["a.weight"], 0), tmp_path / "tp_1_0.pt")
    with pytest.raises(CheckpointError, match=r"no part for \(pp, tp\) = \[\(1, 1\)\]"):
        convert.detect_layout(tmp_path / "tp")
    torch.save(_smp_part(["a.weight"], 0), tmp_path / "gap_1_0.pt")
    with pytest.raises(CheckpointError, match=r"ranks \[0\] are missing"):
        convert.detect_layout(tmp_path / "gap")
    with pytest.raises(CheckpointError, match="No checkpoint parts"):
        convert.detect_layout(tmp_path / "nothing")
    torch.save({"x": torch.zeros(1)}, tmp_path / "full.pt")
    with pytest.raises(CheckpointError, match="already a full state dict"):
        convert.detect_layout(tmp_path / "full.pt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="without model_<pp>_<tp>.pt parts"):
        convert.detect_layout(empty)
    torch.save({"weights": [1, 2]}, tmp_path / "odd_0_0.pt")
    with pytest.raises(CheckpointError, match="--key"):
        convert.merge_model(convert.detect_layout(tmp_path / "odd"))


def test_split_by_plan_balanced_and_as_smp_save_parts(tmp_path: Path) -> None:
    sd = make_model().state_dict()
    plan = {"assignment": {"embed": 0, "": 0, "head": 0, "blocks.0.ln1": 1}, "pp_size": 2, "method": "manual"}
    with pytest.raises(CheckpointError, match="places no module"):
        cutting.split_model(sd, 2, plan)
    with pytest.raises(CheckpointError, match="positive int"):
        cutting.split_model(sd, 0)
    parts = cutting.split_model(sd, 3)
    assert [p["_smp_load_info"]["pipeline_parallel_degree"] for p in parts] == [3, 3, 3]
    keys = [[k for k in p if not k.startswith("_smp")] for p in parts]
    assert all(keys) and sum(len(k) for k in keys) == len(sd)
    assert "embed.weight" in keys[0] and "ln_f.weight" in keys[2]
    plain = tmp_path / "plain.pt"
    torch.save({"model": sd, "epoch": 1}, plain)
    assert main(["checkpoint", "split", str(plain), "--pp", "2", "--layout", "save", "-o", str(tmp_path / "w")]) == 0
    assert sorted(p.name for p in tmp_path.glob("w_*.pt")) == ["w_0_0.pt", "w_1_0.pt"]
    merged = convert.merge_model(convert.detect_layout(tmp_path / "w"))
    assert all(torch.equal(merged[k], v) for k, v in sd.items())
