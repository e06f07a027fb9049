"""The SMP v2 rank layout, pure arithmetic, against worked tables (rank = ((rep*shard + s)*cp + c)*tp + t)."""

from __future__ import annotations

import pytest

from smp_compat.errors import SMPConfigError
from smp_compat.v2.layout import Coords, Layout, resolve_shard_degree

# world 8, tp 2, H 2 (cp 1): 2 replicas of 2 shards of 2 tp ranks
#   rank  rep shard tp  dp_rank  shard group  replicas  tp group
#   0     0   0     0   0        [0, 2]       [0, 4]    [0, 1]
#   1     0   0     1   0        [1, 3]       [1, 5]    [0, 1]
#   2     0   1     0   1        [0, 2]       [2, 6]    [2, 3]
#   3     0   1     1   1        [1, 3]       [3, 7]    [2, 3]
#   4     1   0     0   2        [4, 6]       [0, 4]    [4, 5]
#   5     1   0     1   2        [5, 7]       [1, 5]    [4, 5]
#   6     1   1     0   3        [4, 6]       [2, 6]    [6, 7]
#   7     1   1     1   3        [5, 7]       [3, 7]    [6, 7]
TP2_H2_WORLD8 = [
    (0, 0, 0, 0, [0, 2], [0, 4], [0, 1]),
    (1, 0, 0, 1, [1, 3], [1, 5], [0, 1]),
    (2, 0, 1, 0, [0, 2], [2, 6], [2, 3]),
    (3, 0, 1, 1, [1, 3], [3, 7], [2, 3]),
    (4, 1, 0, 0, [4, 6], [0, 4], [4, 5]),
    (5, 1, 0, 1, [5, 7], [1, 5], [4, 5]),
    (6, 1, 1, 0, [4, 6], [2, 6], [6, 7]),
    (7, 1, 1, 1, [5, 7], [3, 7], [6, 7]),
]


@pytest.mark.parametrize("row", TP2_H2_WORLD8, ids=lambda r: f"rank{r[0]}")
def test_tp2_hsd2_world8_table(row: tuple) -> None:
    rank, rep, shard, tp, shard_group, replicas, tp_group = row
    layout = Layout(8, tp=2, cp=1, shard_degree=2)
    assert layout.mesh_shape == (2, 2, 1, 2)
    assert layout.coords(rank) == Coords(rep, shard, 0, tp)
    assert layout.rank_of(Coords(rep, shard, 0, tp)) == rank
    assert layout.dp_rank(rank) == rank // 2
    assert layout.shard_group(rank) == shard_group
    assert layout.replicate_group(rank) == replicas
    assert layout.tp_group(rank) == tp_group
    assert layout.rep_rank_group(rank) == [r for r in range(8) if r // 4 == rep]
    assert layout.dp_group(rank) == [r for r in range(8) if r % 2 == tp]


def test_context_parallel_ranks_sit_inside_the_shard_group() -> None:
    # world 8, tp 2, cp 2, H 4: one replica... no: rep = 8 / (4 * 2) = 1, shard = 4 / 2 = 2
    layout = Layout(8, tp=2, cp=2, shard_degree=4)
    assert layout.mesh_shape == (1, 2, 2, 2)
    assert layout.coords(5) == Coords(0, 1, 0, 1)
    assert layout.cp_group(5) == [5, 7]
    assert layout.shard_group(5) == [1, 3, 5, 7]  # H = 4 ranks: 2 data shards x 2 cp ranks, one tp rank
    assert layout.dp_rank(5) == 1  # rank // (tp * cp), as the scripts compute it
    assert layout.dp_size == 2


@pytest.mark.parametrize(
    ("hsd", "world", "tp", "local", "strategy", "expected"),
    [
        (4, 8, 2, 8, None, 4),  # as given
        (1, 8, 2, 8, None, 1),  # replicate only
        (0, 8, 2, 8, None, 4),  # tp > 1: every data-parallel rank
        (0, 8, 1, 4, None, 8),  # native FSDP, no strategy known yet: full sharding
        (0, 8, 1, 4, "FULL_SHARD", 8),
        (0, 8, 1, 4, "SHARD_GRAD_OP", 8),
        (0, 8, 1, 4, "HYBRID_SHARD", 4),  # one node's ranks
        (0, 8, 1, 4, "_HYBRID_SHARD_ZERO2", 4),
        (0, 8, 1, 4, "NO_SHARD", 1),
    ],
)
def test_resolve_shard_degree(hsd: int, world: int, tp: int, local: int, strategy: str | None, expected: int) -> None:
    assert resolve_shard_degree(hsd, world, tp, local, strategy) == expected


def test_resolve_accepts_torch_sharding_strategy_members() -> None:
    from torch.distributed.fsdp import ShardingStrategy

    assert resolve_shard_degree(0, 8, 1, 2, ShardingStrategy.HYBRID_SHARD) == 2


def test_hybrid_shard_within_a_node_that_does_not_tile_the_world_is_refused() -> None:
    with pytest.raises(SMPConfigError, match="hybrid_shard_degree explicitly"):
        resolve_shard_degree(0, 6, 1, 4, "HYBRID_SHARD")


def test_impossible_layout_and_rank_are_refused() -> None:
    with pytest.raises(SMPConfigError, match="no SMP v2 layout"):
        Layout(6, tp=2, cp=1, shard_degree=2)
    with pytest.raises(SMPConfigError, match="outside the world"):
        Layout(4, tp=1, cp=1, shard_degree=2).coords(4)


def test_rank_table_for_dry_run_names_every_group() -> None:
    lines = Layout(4, tp=2, cp=1, shard_degree=2).rank_table()
    assert lines[0].startswith("SMP v2 layout: world 4 = rep 1 x shard 2 x cp 1 x tp 2")
    assert lines[4] == "  rank 3: tp_rank 1 cp_rank 0 dp_rank 1 rep_rank 0 | tp [2, 3] cp [3] shard [1, 3] replicas [3]"
