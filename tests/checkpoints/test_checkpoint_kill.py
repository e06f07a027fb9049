"""A save killed at any point leaves the previous checkpoint loadable and ``newest`` pointing at it (§4.9)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import smp_compat as smp
from smp_compat.checkpoints import folders as checkpoints
from smp_compat.checkpoints.folders import read_newest
from smp_compat.errors import CheckpointError

__all__: list[str] = []

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # import torch._dynamo once, before forking

KILLS = 6
WIDTH = 1536  # 1536 x 1536 floats: a 9 MiB model file, so a kill usually lands inside a write



def _model() -> nn.Module:
    return nn.Linear(WIDTH, WIDTH, bias=False)


def _save_forever(directory: str, first: int, started: Any) -> None:
    """Child: checkpoint after checkpoint; every tensor of save i holds the value i, like its user_content."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    torch.set_num_threads(1)
    smp.init({})
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    started.set()
    i = first
    while True:
        with torch.no_grad():
            model.module.weight.fill_(float(i))
        smp.save_checkpoint(directory, f"s{i}", model=model, optimizer=opt, user_content={"i": i},
                            num_kept_partial_checkpoints=2)  # fmt: skip
        i += 1


def _verify_folder(folder: Path) -> int:
    """A published folder is whole: its model holds the value its user_content names."""
    i = torch.load(folder / "user_content.pt", weights_only=True)["i"]
    part = torch.load(folder / "model_0_0.pt", weights_only=True)
    assert part["_smp_is_partial"] is True
    assert torch.equal(part["weight"], torch.full((WIDTH, WIDTH), float(i)))
    torch.load(folder / "optimizer_states_0_0.pt", weights_only=True)
    torch.load(folder / "smp_config.pt", weights_only=True)
    return i


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_sigkill_during_save_checkpoint_keeps_the_previous_one(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    rng = random.Random(1234)
    newest_seen: list[int] = []
    interrupted = 0
    for attempt in range(KILLS):
        started = ctx.Event()
        child = ctx.Process(target=_save_forever, args=(str(tmp_path), 1000 * attempt, started), daemon=True)
        child.start()
        try:
            assert started.wait(30), "the saving child did not start"
            if attempt == 0:
                while not read_newest(tmp_path):  # let the first checkpoint complete
                    assert child.is_alive()
            else:
                _wait_a_little(rng)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
        assert child.exitcode == -signal.SIGKILL
        interrupted += bool(_leftovers(tmp_path))
        names = read_newest(tmp_path)
        assert 1 <= len(names) <= 2
        newest_seen.append(_verify_folder(checkpoints.checkpoint_folder(tmp_path, None)))
        for name in names:
            _verify_folder(checkpoints.checkpoint_folder(tmp_path, name))
    assert newest_seen == sorted(newest_seen)  # never goes back
    assert interrupted >= 1, "no kill landed inside a save; the test did not test anything"
    smp.init({})
    model = smp.DistributedModel(_model())
    content = smp.resume_from_checkpoint(tmp_path)
    assert content == {"i": newest_seen[-1]}
    _partition(model)
    assert torch.equal(model.module.weight, torch.full((WIDTH, WIDTH), float(newest_seen[-1])))
    smp.save_checkpoint(tmp_path, "after", model=model)
    assert _leftovers(tmp_path) == []  # the next save cleans up what the kills left


def _wait_a_little(rng: random.Random) -> None:
    import time

    time.sleep(rng.uniform(0.02, 0.4))


def _partition(model: Any) -> None:
    @smp.step
    def look(model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with torch.no_grad():
        look(model, torch.zeros(1, WIDTH))


# ---------------------------------------------------------------------------- crashes inside the write


@pytest.mark.parametrize("failing_file", ["optimizer_states_0_0.pt", "smp_config.pt"])
def test_a_failed_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_file: str
) -> None:
    smp.init({})
    model = smp.DistributedModel(nn.Linear(3, 3))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    smp.save_checkpoint(tmp_path, "good", model=model, optimizer=opt, user_content="good")
    real = checkpoints.atomic_save

    def crash_on(obj: Any, path: Any, **kwargs: Any) -> None:
        if Path(path).name == failing_file:
            with open(path, "wb") as handle:
                handle.write(b"half a file")
            raise OSError("disk full")
        real(obj, path, **kwargs)

    monkeypatch.setattr(checkpoints, "atomic_save", crash_on)
    with pytest.raises(CheckpointError, match=r"rank 0: OSError: disk full.*unchanged"):
        smp.save_checkpoint(tmp_path, "bad", model=model, optimizer=opt, user_content="bad")
    monkeypatch.undo()
    assert read_newest(tmp_path) == ["good_partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good_partial", "newest"]  # staging removed
    assert smp.resume_from_checkpoint(tmp_path) == "good"


def test_a_failed_newest_update_keeps_the_previous_pointer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smp.init({})
    model = smp.DistributedModel(nn.Linear(3, 3))
    smp.save_checkpoint(tmp_path, "good", model=model, user_content="good")
    real = checkpoints.atomic_write

    def half_write(path: Path, write: Any) -> None:
        if Path(path).name != "newest":
            return real(path, write)
        with open(Path(path).with_name(".newest.tmp-00ff"), "wb") as handle:
            handle.write(b"nex")  # a kill in the middle of writing the new pointer
        raise OSError("killed")

    monkeypatch.setattr(checkpoints, "atomic_write", half_write)
    with pytest.raises(CheckpointError, match="killed"):
        smp.save_checkpoint(tmp_path, "next", model=model, user_content="next")
    monkeypatch.setattr(checkpoints, "atomic_write", real)
    assert read_newest(tmp_path) == ["good_partial"]
    assert smp.resume_from_checkpoint(tmp_path) == "good"
    assert smp.resume_from_checkpoint(tmp_path, "next") == "next"  # published, just not the newest yet
