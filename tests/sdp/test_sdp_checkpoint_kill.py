"""A sharded-DP save killed at any point (all ranks SIGKILLed) keeps the previous checkpoint whole."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from smp_compat.checkpoints import folders as checkpoints
from smp_compat.checkpoints.folders import read_newest
from smp_compat.sdp.checkpoint import merge_sharded

KILLS = 3
WIDTH = 512
_CHILD = r"""
import sys, torch
from torch import nn
from smp_compat.testing import run_ranks

def save_forever(directory, first):
    import smp_compat as smp
    torch.set_num_threads(1)
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2})
    model = smp.DistributedModel(nn.Sequential(nn.Linear(%d, %d, bias=False), nn.Linear(%d, %d, bias=False)))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    i = first
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(float(i))
        smp.save_checkpoint(directory, f"s{i}", model=model, optimizer=opt, user_content={"i": i},
                            num_kept_partial_checkpoints=2)
        i += 1

run_ranks(save_forever, 2, sys.argv[1], int(sys.argv[2]), timeout=600)
""" % ((WIDTH,) * 4)


def _verify(folder: Path) -> int:
    i = torch.load(folder / "user_content.pt", weights_only=True)["i"]
    model, _ = merge_sharded(folder)
    for value in model.values():
        assert torch.equal(value, torch.full((WIDTH, WIDTH), float(i)))
    return i


def test_sigkill_of_every_rank_during_a_sharded_save_keeps_the_previous_one(tmp_path: Path) -> None:
    rng = random.Random(7)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    seen: list[int] = []
    interrupted = 0
    for attempt in range(KILLS):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), str(1000 * attempt)], env=env,
                                 start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            before = list(read_newest(tmp_path))
            while read_newest(tmp_path) == before:  # let one save of this job complete
                assert child.poll() is None and time.monotonic() < deadline, "the saving job did not save"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(20)
        interrupted += any(p.name.startswith(".") for p in tmp_path.iterdir())
        names = read_newest(tmp_path)
        assert 1 <= len(names) <= 2
        seen.append(_verify(checkpoints.checkpoint_folder(tmp_path, None)))
        for name in names:
            _verify(checkpoints.checkpoint_folder(tmp_path, name))
    assert seen == sorted(seen)
    assert interrupted >= 1, "no kill landed inside a save; the test did not test anything"
