"""``checkpoints.tp_reshard``: pp x tp part grids cut from whole tensors and joined back (model and Adam state).

The real-job round trips (tp = 2 -> 1 -> 2, resumed and trained) are in tests/cli/test_checkpoint_tp.py;
here the layouts no job of this version can save yet (pp x tp) and the cases a job never hits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from smp_compat.checkpoints import cutting, tp_reshard
from smp_compat.cli import main
from smp_compat.errors import CheckpointError

__all__: list[str] = []

TABLE = {
    "a.weight": {"dim": 0, "blocks": 1, "shape": [8, 4]},  # column-parallel weight and its bias
    "a.bias": {"dim": 0, "blocks": 1, "shape": [8]},
    "qkv.weight": {"dim": 0, "blocks": 3, "shape": [12, 4]},  # fused q|k|v: each block cut on its own
    "b.weight": {"dim": 1, "blocks": 1, "shape": [4, 8]},  # row-parallel weight
}


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {**{k: v["shape"] for k, v in TABLE.items()}, "b.bias": [4], "ln.weight": [4]}
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


def _adam(full: dict[str, torch.Tensor]) -> dict:
    names = list(full)
    state = {i: {"step": torch.tensor(3.0), "exp_avg": full[n] * 0.1, "exp_avg_sq": full[n] ** 2} for i, n in
             enumerate(names)}  # fmt: skip
    return {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(len(names)))}],
            "_smp_param_names": names}  # fmt: skip


def _write(full: dict, optimizer: dict, pp: int, tp: int, root: Path) -> Path:
    parts = cutting.split_model(full, pp)
    owners = cutting.module_owners(full, pp, None)
    grid, optimizer_grid = tp_reshard.split_grid(parts, tp, TABLE, optimizer, owners)
    return cutting.write_checkpoint_parts(grid, root, "t", None, optimizer_grid)


@pytest.mark.parametrize(("pp", "tp"), [(2, 2), (1, 4), (2, 1)])
def test_pp_x_tp_grid_merges_back_to_the_whole_model_and_adam_state(pp: int, tp: int, tmp_path: Path) -> None:
    full = _full()
    optimizer = _adam(full)
    folder = _write(full, optimizer, pp, tp, tmp_path / "ck")
    names = sorted(p.name for p in folder.glob("*_states_*.pt"))
    assert names == sorted(f"optimizer_states_{p}_{t}.pt" for p in range(pp) for t in range(tp))
    local = torch.load(folder / "model_0_0.pt", weights_only=True)
    assert local["a.weight"].shape == (8 // tp, 4) and local["_smp_load_info"]["tensor_parallel_degree"] == tp
    out, opt_out = tmp_path / "m.pt", tmp_path / "o.pt"
    assert main(["checkpoint", "merge", str(tmp_path / "ck"), "-o", str(out), "--optimizer-output", str(opt_out)]) == 0
    merged = torch.load(out, weights_only=True)
    assert list(merged) == list(full) and all(torch.equal(merged[k], v) for k, v in full.items())
    merged_opt = torch.load(opt_out, weights_only=True)
    assert merged_opt["_smp_param_names"] == optimizer["_smp_param_names"]
    for i, s in optimizer["state"].items():
        for key, value in s.items():
            assert torch.equal(merged_opt["state"][i][key], value), (i, key)


def test_fused_blocks_are_cut_per_block() -> None:
    qkv = torch.arange(12.0).unsqueeze(1)  # q = 0..3, k = 4..7, v = 8..11
    grid, _ = tp_reshard.split_grid([{"qkv.weight": qkv}], 2, {"qkv.weight": TABLE["qkv.weight"] | {"shape": [12, 1]}})
    assert grid[0][0]["qkv.weight"].flatten().tolist() == [0, 1, 4, 5, 8, 9]  # whole heads of q, k and v
    assert grid[0][1]["qkv.weight"].flatten().tolist() == [2, 3, 6, 7, 10, 11]


def test_what_cannot_be_cut_is_refused(tmp_path: Path) -> None:
    full = _full()
    with pytest.raises(CheckpointError, match="not divisible by 3"):
        tp_reshard.split_grid([full], 3, TABLE)
    fused = {"qkv.weight": {"dim": 0, "blocks": 3, "shape": [6, 1]}}  # q, k, v of 2 rows: not 2 per tp rank
    with pytest.raises(CheckpointError, match="in each of its 3 blocks: 6 is not divisible by 12"):
        tp_reshard.split_grid([{"qkv.weight": torch.zeros(6, 1)}], 4, fused)
    with pytest.raises(CheckpointError, match="--like"):
        tp_reshard.split_grid([full], 2, None)
    odd = _adam(full)
    odd["state"][0]["exp_avg"] = torch.zeros(3)  # a factored state of another shape cannot follow the shard
    with pytest.raises(CheckpointError, match="cannot be re-cut"):
        tp_reshard.split_grid([full], 2, TABLE, odd, None)
    unnamed = {k: v for k, v in _adam(full).items() if k != "_smp_param_names"}
    with pytest.raises(CheckpointError, match="no parameter names"):
        tp_reshard.split_grid([full], 2, TABLE, unnamed, None)
    bad = dict(full, **{"a.weight": torch.zeros(6, 4)})
    with pytest.raises(CheckpointError, match="shard record says"):
        tp_reshard.split_grid([bad], 2, TABLE)
