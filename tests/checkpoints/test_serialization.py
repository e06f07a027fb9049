"""smp.save / smp.load: SMP's file names, full saves, part checks, atomic writes, safe loading (§2.7, §4.9)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_compat as smp
from smp_compat.checkpoints.convert import load_file
from smp_compat.errors import CheckpointError, SMPNotInitializedError
from smp_compat.testing import run_ranks

__all__: list[str] = []


class Opaque:
    """An arbitrary class instance: safe loading must refuse it."""

    def __init__(self, value: int) -> None:
        self.value = value



def _names(directory: Path) -> list[str]:
    """The files saved, without the keyed digest beside each (checkpoints.signing)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".hmac"))


# ---------------------------------------------------------------------------- rank functions (forked)


def _partial_pp2(directory: str) -> dict[str, Any]:
    """pp = 2 on 2 ranks: each pipeline stage writes and reads its own part, new and legacy names."""
    smp.init({"pipeline_parallel_degree": 2})
    base = os.path.join(directory, "model.pt")
    smp.save({"stage": smp.pp_rank(), "w": torch.full((2,), float(smp.rank()))}, base)
    torch.save({"legacy": smp.mp_rank()}, os.path.join(directory, f"old.pt_{smp.mp_rank()}"))
    smp.barrier()
    legacy = smp.load(os.path.join(directory, "old.pt"), back_compat=True)
    return {"pp": smp.pp_rank(), "part": smp.load(base), "legacy": legacy}


def _v3_and_full(directory: str) -> dict[str, Any]:
    """dp = 2 on 2 ranks: v3 adds rdp_rank to the name; a full save is written by rank 0 only."""
    smp.init({"ddp": True})
    me = smp.rank()
    smp.save({"rdp": smp.rdp_rank()}, os.path.join(directory, "opt"), v3=True)
    smp.save({"writer": me}, os.path.join(directory, "full.pt"), partial=False)
    smp.save({"writer": me}, os.path.join(directory, f"only_{me}.pt"), partial=False)
    smp.barrier()
    return {"rank": me, "full": smp.load(os.path.join(directory, "full.pt"), partial=False)}


# ---------------------------------------------------------------------------- names


def test_partial_save_name_and_round_trip_in_a_world_of_one(tmp_path: Path) -> None:
    smp.init({})
    state = {"w": torch.arange(4.0), "step": 7}
    smp.save(state, tmp_path / "ckpt.pt")
    assert _names(tmp_path) == ["ckpt.pt_0_0.pt"]
    loaded = smp.load(tmp_path / "ckpt.pt")
    torch.testing.assert_close(loaded["w"], state["w"])
    assert loaded["step"] == 7


def test_v3_name_adds_the_rdp_rank(tmp_path: Path) -> None:
    smp.init({})
    smp.save({"a": 1}, str(tmp_path / "opt"), v3=True)
    assert _names(tmp_path) == ["opt_0_0_0.pt"]


def test_partial_names_per_pipeline_stage_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(_partial_pp2, 2, str(tmp_path), timeout=30)
    assert _names(tmp_path) == ["model.pt_0_0.pt", "model.pt_1_0.pt", "old.pt_0", "old.pt_1"]
    for r in results:
        assert r["part"]["stage"] == r["pp"]
        torch.testing.assert_close(r["part"]["w"], torch.full((2,), float(r["pp"])))
        assert r["legacy"] == {"legacy": r["pp"]}  # back_compat reads {f}_{mp_rank}; mp_rank = pp_rank at tp = 1


def test_v3_names_and_full_save_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(_v3_and_full, 2, str(tmp_path), timeout=30)
    assert _names(tmp_path) == ["full.pt", "only_0.pt", "opt_0_0_0.pt", "opt_0_0_1.pt"]  # no only_1.pt
    assert [r["full"] for r in results] == [{"writer": 0}, {"writer": 0}]
    for rdp in (0, 1):
        assert torch.load(tmp_path / f"opt_0_0_{rdp}.pt") == {"rdp": rdp}


def test_save_and_load_need_init(tmp_path: Path) -> None:
    with pytest.raises(SMPNotInitializedError, match="smp.save"):
        smp.save({}, tmp_path / "x.pt")
    with pytest.raises(SMPNotInitializedError, match="smp.load"):
        smp.load(tmp_path / "x.pt")


# ---------------------------------------------------------------------------- part checks


def test_loading_parts_of_another_pipeline_degree_lists_them(tmp_path: Path) -> None:
    run_ranks(_partial_pp2, 2, str(tmp_path), timeout=30)  # writes model.pt_{0,1}_0.pt
    smp.init({})  # pp = 1 here
    with pytest.raises(CheckpointError, match=r"found parts \[\(0, 0\), \(1, 0\)\].*needs \[\(0, 0\)\]") as info:
        smp.load(tmp_path / "model.pt")
    assert "pipeline_parallel_degree=1" in str(info.value)


def test_loading_with_no_parts_says_none(tmp_path: Path) -> None:
    smp.init({})
    with pytest.raises(CheckpointError, match=r"found parts none"):
        smp.load(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match=r"found parts none"):  # the directory itself is missing
        smp.load(tmp_path / "no_such_dir" / "model.pt")


def test_back_compat_name_and_part_check(tmp_path: Path) -> None:
    smp.init({})
    torch.save({"old": True}, tmp_path / "legacy.pt_0")
    assert smp.load(tmp_path / "legacy.pt", back_compat=True) == {"old": True}
    torch.save({"old": True}, tmp_path / "legacy.pt_1")  # a part of a pp = 2 job
    with pytest.raises(CheckpointError, match=r"found parts \[\(0,\), \(1,\)\]"):
        smp.load(tmp_path / "legacy.pt", back_compat=True)


# ---------------------------------------------------------------------------- atomic writes


@pytest.mark.parametrize("partial", [True, False])
def test_interrupted_save_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, partial: bool
) -> None:
    smp.init({})
    target = tmp_path / "ckpt.pt"
    smp.save({"version": 1}, target, partial=partial)
    before = _names(tmp_path)

    def broken_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        smp.save({"version": 2}, target, partial=partial)
    monkeypatch.undo()
    assert _names(tmp_path) == before  # no temporary file left behind
    assert smp.load(target, partial=partial) == {"version": 1}


# ---------------------------------------------------------------------------- safe loading


@pytest.mark.parametrize("partial", [True, False])
def test_safe_loading_refuses_arbitrary_objects(tmp_path: Path, partial: bool) -> None:
    smp.init({})
    target = tmp_path / "obj.pt"
    smp.save({"thing": Opaque(3)}, target, partial=partial)
    for digest in tmp_path.glob("*.hmac"):  # as a file smp_compat did not write (checkpoints.signing)
        digest.unlink()
    with pytest.raises(CheckpointError, match="weights_only=False") as info:
        smp.load(target, partial=partial)
    assert "obj.pt" in str(info.value)
    loaded = smp.load(target, partial=partial, weights_only=False)
    assert isinstance(loaded["thing"], Opaque) and loaded["thing"].value == 3


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_truncated_or_corrupt_file_is_named_not_loaded(tmp_path: Path, weights_only: bool) -> None:
    """torch's own errors ([Errno 22], an empty EOFError, a miniz message) do not say which file is damaged."""
    smp.init({})
    smp.save({"w": torch.ones(64)}, tmp_path / "good.pt", partial=False)
    data = (tmp_path / "good.pt").read_bytes()
    damaged = {"empty": b"", "one_byte": data[:1], "no_directory": data[:100], "half": data[: len(data) // 2],
               "zeroed": data[:400] + bytes(200) + data[600:]}  # fmt: skip
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=rf"'{re.escape(str(tmp_path / name))}' is truncated or unreadable"):
            smp.load(tmp_path / name, partial=False, weights_only=weights_only)
    with pytest.raises(CheckpointError, match=r"half' is truncated or unreadable"):
        load_file(tmp_path / "half", unsafe=not weights_only)  # `smp-compat checkpoint` reads the same way
    with pytest.raises(FileNotFoundError):  # names the file already, as torch.load's callers expect
        smp.load(tmp_path / "absent.pt", partial=False)
