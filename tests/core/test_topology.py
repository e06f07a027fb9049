"""Tests for smp_compat.topology: SMP_REFERENCE §3 worked tables, §2.8 identities, group invariants."""

from __future__ import annotations

from itertools import permutations

import pytest

from smp_compat.errors import SMPConfigError
from smp_compat.topology import AXES, VALID_PLACEMENTS, Coords, Topology, placement_letters

PERMS = ["".join(p) for p in permutations("DPT")]
STRATEGIES = [*PERMS, "cluster", "spread"]
SHAPES = [  # (world, pp, tp)
    (1, 1, 1),
    (2, 2, 1),
    (2, 1, 2),
    (6, 3, 1),
    (6, 1, 3),
    (8, 2, 2),
    (12, 2, 3),
    (12, 3, 2),
    (30, 5, 3),
    (36, 3, 4),
]


# ------------------------------------------------------------------ placement_letters


@pytest.mark.parametrize(("value", "letters"), [("cluster", "DPT"), ("spread", "TPD"), *[(p, p) for p in PERMS]])
def test_placement_letters_accepts_aliases_and_permutations(value: str, letters: str) -> None:
    assert placement_letters(value) == letters


@pytest.mark.parametrize("bad", ["", "DP", "DPTD", "DPP", "dpt", "Cluster", "random", None, 3])
def test_placement_letters_rejects_anything_else(bad: object) -> None:
    with pytest.raises(SMPConfigError) as info:
        placement_letters(bad)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(bad) in message
    for valid in VALID_PLACEMENTS:
        assert repr(valid) in message


def test_valid_placements_are_two_aliases_and_six_permutations() -> None:
    assert sorted(VALID_PLACEMENTS) == sorted(STRATEGIES)


# ------------------------------------------------------------------ worked example A (§3)

# rank -> (pp_rank, dp_rank); 8 GPUs, pp=2, dp=4, tp=1
TABLE_A = {
    "cluster": [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)],
    "spread": [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)],
}
GROUPS_A = {
    "cluster": {"mp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]]},
    "spread": {"mp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 1, 2, 3], [4, 5, 6, 7]]},
}


@pytest.mark.parametrize("strategy", ["cluster", "spread"])
def test_worked_example_a_ranks(strategy: str) -> None:
    topo = Topology.build(8, pp_size=2, placement_strategy=strategy)
    assert (topo.dp_size, topo.mp_size, topo.rdp_size) == (4, 2, 4)
    for rank, (pp, dp) in enumerate(TABLE_A[strategy]):
        c = topo.coords(rank)
        assert (c.pp_rank, c.dp_rank) == (pp, dp), rank
        assert c.tp_rank == 0 and c.rdp_rank == dp and c.mp_rank == pp


@pytest.mark.parametrize("strategy", ["cluster", "spread"])
def test_worked_example_a_groups(strategy: str) -> None:
    topo = Topology.build(8, pp_size=2, placement_strategy=strategy)
    for axis, groups in GROUPS_A[strategy].items():
        assert topo.all_groups(axis) == groups
    # With tp == 1 a pp group is an mp group and an rdp group is a dp group.
    assert topo.all_groups("pp") == topo.all_groups("mp")
    assert topo.all_groups("rdp") == topo.all_groups("dp")
    assert topo.all_groups("tp") == [[r] for r in range(8)]


# ------------------------------------------------------------------ worked example B (§3)

# rank -> (pp, tp, rdp, dp, mp); 8 GPUs, pp=2, tp=2, rdp=2
TABLE_B = {
    "DPT": ["0,0,0/0,0", "0,1,0/1,1", "1,0,0/0,2", "1,1,0/1,3", "0,0,1/2,0", "0,1,1/3,1", "1,0,1/2,2", "1,1,1/3,3"],
    "TPD": ["0,0,0/0,0", "0,0,1/1,0", "1,0,0/0,1", "1,0,1/1,1", "0,1,0/2,2", "0,1,1/3,2", "1,1,0/2,3", "1,1,1/3,3"],
    "PTD": ["0,0,0/0,0", "0,0,1/1,0", "0,1,0/2,1", "0,1,1/3,1", "1,0,0/0,2", "1,0,1/1,2", "1,1,0/2,3", "1,1,1/3,3"],
    "DTP": ["0,0,0/0,0", "1,0,0/0,1", "0,1,0/1,2", "1,1,0/1,3", "0,0,1/2,0", "1,0,1/2,1", "0,1,1/3,2", "1,1,1/3,3"],
}
GROUPS_B_DPT = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "rdp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "mp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "world": [list(range(8))],
}


def _parse_row(row: str) -> tuple[int, ...]:
    left, right = row.split("/")
    return tuple(int(v) for v in (*left.split(","), *right.split(",")))


@pytest.mark.parametrize("placement", sorted(TABLE_B))
def test_worked_example_b_ranks(placement: str) -> None:
    topo = Topology.build(8, pp_size=2, tp_size=2, placement_strategy=placement)
    for rank, row in enumerate(TABLE_B[placement]):
        c = topo.coords(rank)
        assert (c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank, c.mp_rank) == _parse_row(row), (placement, rank)


@pytest.mark.parametrize(("alias", "letters"), [("cluster", "DPT"), ("spread", "TPD")])
def test_aliases_give_the_letter_layout(alias: str, letters: str) -> None:
    assert Topology.build(8, 2, 2, alias) == Topology.build(8, 2, 2, letters)
    assert Topology.build(8, 2, 2, alias).placement == letters


def test_default_placement_is_cluster() -> None:
    assert Topology.build(8, 2, 2).placement == "DPT"


@pytest.mark.parametrize("axis", sorted(GROUPS_B_DPT))
def test_worked_example_b_groups(axis: str) -> None:
    topo = Topology.build(8, pp_size=2, tp_size=2)
    assert topo.all_groups(axis) == GROUPS_B_DPT[axis]


def test_worked_example_b_dp_groups_by_pp_rank() -> None:
    topo = Topology.build(8, pp_size=2, tp_size=2)
    for rank in range(8):
        assert topo.get_dp_group(rank, pp_rank=0) == [0, 1, 4, 5]
        assert topo.get_dp_group(rank, pp_rank=1) == [2, 3, 6, 7]


def test_dtp_is_the_developer_guide_layout() -> None:
    """The DG page's pipeline pairs (0,1),(2,3) and TP pairs (0,2),(1,3) are DTP, not cluster (§3 trap)."""
    topo = Topology.build(8, 2, 2, "DTP")
    assert topo.all_groups("pp")[:2] == [[0, 1], [2, 3]]
    assert topo.all_groups("tp")[:2] == [[0, 2], [1, 3]]


# ------------------------------------------------------------------ identities and invariants, many layouts

LAYOUTS = [(w, p, t, s) for (w, p, t) in SHAPES for s in STRATEGIES]


@pytest.fixture(params=LAYOUTS, ids=lambda v: f"w{v[0]}-pp{v[1]}-tp{v[2]}-{v[3]}")
def topo(request: pytest.FixtureRequest) -> Topology:
    world, pp, tp, strategy = request.param
    return Topology.build(world, pp, tp, strategy)


def test_size_identities(topo: Topology) -> None:
    w = topo.world_size
    assert topo.pp_size * topo.dp_size == w
    assert topo.mp_size * topo.rdp_size == w
    assert topo.pp_size * topo.tp_size * topo.rdp_size == w
    assert topo.rdp_size == topo.dp_size // topo.tp_size
    assert (topo.mp_size * topo.dp_size == w) == (topo.tp_size == 1)


def test_coordinates_are_a_bijection(topo: Topology) -> None:
    rows = topo.table()
    assert [c.rank for c in rows] == list(range(topo.world_size))
    assert len({(c.pp_rank, c.tp_rank, c.rdp_rank) for c in rows}) == topo.world_size
    assert len({(c.pp_rank, c.dp_rank) for c in rows}) == topo.world_size
    assert len({(c.rdp_rank, c.mp_rank) for c in rows}) == topo.world_size
    for c in rows:
        assert topo.rank_of(c.pp_rank, c.tp_rank, c.rdp_rank) == c.rank
        assert 0 <= c.dp_rank < topo.dp_size and 0 <= c.mp_rank < topo.mp_size


def test_right_most_letter_varies_fastest(topo: Topology) -> None:
    digits = {"D": "rdp_rank", "P": "pp_rank", "T": "tp_rank"}
    fast, middle, slow = (digits[letter] for letter in reversed(topo.placement))
    radix = {"rdp_rank": topo.rdp_size, "pp_rank": topo.pp_size, "tp_rank": topo.tp_size}
    for c in topo.table():
        assert getattr(c, fast) == c.rank % radix[fast]
        assert getattr(c, middle) == (c.rank // radix[fast]) % radix[middle]
        assert getattr(c, slow) == c.rank // (radix[fast] * radix[middle])


def test_derived_ranks_follow_the_letter_order(topo: Topology) -> None:
    t_before_d = topo.placement.index("T") < topo.placement.index("D")
    t_before_p = topo.placement.index("T") < topo.placement.index("P")
    for c in topo.table():
        if t_before_d:
            assert c.dp_rank == c.rdp_rank + topo.rdp_size * c.tp_rank
        else:
            assert c.dp_rank == c.tp_rank + topo.tp_size * c.rdp_rank
        if t_before_p:
            assert c.mp_rank == c.pp_rank + topo.pp_size * c.tp_rank
        else:
            assert c.mp_rank == c.tp_rank + topo.tp_size * c.pp_rank


@pytest.mark.parametrize("axis", AXES)
def test_every_rank_in_exactly_one_group(topo: Topology, axis: str) -> None:
    groups = topo.all_groups(axis)
    members = [r for g in groups for r in g]
    assert sorted(members) == list(range(topo.world_size))
    assert groups == sorted(groups, key=min)
    expected_size = {
        "pp": topo.pp_size,
        "tp": topo.tp_size,
        "rdp": topo.rdp_size,
        "dp": topo.dp_size,
        "mp": topo.mp_size,
        "world": topo.world_size,
    }[axis]
    assert all(len(g) == expected_size for g in groups)


# Which coordinates a group on each axis holds fixed.
FIXED = {
    "pp": ("tp_rank", "rdp_rank"),
    "tp": ("pp_rank", "rdp_rank"),
    "rdp": ("pp_rank", "tp_rank"),
    "dp": ("pp_rank",),
    "mp": ("rdp_rank",),
    "world": (),
}


@pytest.mark.parametrize("axis", AXES)
def test_group_is_ordered_by_group_rank(topo: Topology, axis: str) -> None:
    for rank in range(topo.world_size):
        group = topo.group(axis, rank)
        assert group[topo.group_rank(axis, rank)] == rank
        assert [topo.group_rank(axis, m) for m in group] == list(range(len(group)))
        for member in group:
            assert topo.group(axis, member) == group
            for name in FIXED[axis]:
                assert getattr(topo.coords(member), name) == getattr(topo.coords(rank), name)


def test_group_rank_matches_coords(topo: Topology) -> None:
    for c in topo.table():
        assert topo.group_rank("pp", c.rank) == c.pp_rank
        assert topo.group_rank("tp", c.rank) == c.tp_rank
        assert topo.group_rank("rdp", c.rank) == c.rdp_rank
        assert topo.group_rank("dp", c.rank) == c.dp_rank
        assert topo.group_rank("mp", c.rank) == c.mp_rank
        assert topo.group_rank("world", c.rank) == c.rank


def test_get_helpers_default_to_own_group(topo: Topology) -> None:
    for r in range(topo.world_size):
        assert topo.get_pp_group(r) == topo.group("pp", r)
        assert topo.get_dp_group(r) == topo.group("dp", r)
        assert topo.get_mp_group(r) == topo.group("mp", r)
        assert topo.get_tp_group(r) == topo.group("tp", r)
        assert topo.get_rdp_group(r) == topo.group("rdp", r)


def test_get_helpers_select_the_group_with_those_coordinates(topo: Topology) -> None:
    me = 0
    for c in topo.table():
        assert topo.get_pp_group(me, dp_rank=c.dp_rank) == topo.group("pp", c.rank)
        assert topo.get_dp_group(me, pp_rank=c.pp_rank) == topo.group("dp", c.rank)
        assert topo.get_mp_group(me, rdp_rank=c.rdp_rank) == topo.group("mp", c.rank)
        assert topo.get_tp_group(me, pp_rank=c.pp_rank, rdp_rank=c.rdp_rank) == topo.group("tp", c.rank)
        assert topo.get_rdp_group(me, pp_rank=c.pp_rank, tp_rank=c.tp_rank) == topo.group("rdp", c.rank)


def test_get_helpers_mix_given_and_own_coordinates() -> None:
    topo = Topology.build(8, 2, 2)  # rank 5: pp 0, tp 1, rdp 1
    assert topo.get_tp_group(5, pp_rank=1) == [6, 7]
    assert topo.get_tp_group(5, rdp_rank=0) == [0, 1]
    assert topo.get_rdp_group(5, pp_rank=1) == [3, 7]
    assert topo.get_rdp_group(5, tp_rank=0) == [0, 4]
    assert topo.get_pp_group(5, dp_rank=0) == [0, 2]
    assert topo.get_mp_group(5, rdp_rank=0) == [0, 1, 2, 3]


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("world", "pp", "tp", "needle"),
    [
        (8, 3, 1, "must divide the world size (8)"),
        (8, 2, 3, "= 6"),
        (2, 2, 2, "must divide"),
        (0, 1, 1, "world size"),
        (8, 0, 1, "pipeline_parallel_degree"),
        (8, 1, -2, "tensor_parallel_degree"),
        (8, True, 1, "pipeline_parallel_degree"),
        (8, 2.0, 1, "pipeline_parallel_degree"),
    ],
)
def test_build_rejects_bad_degrees(world: object, pp: object, tp: object, needle: str) -> None:
    with pytest.raises(SMPConfigError) as info:
        Topology.build(world, pp, tp)  # type: ignore[arg-type]
    assert needle in str(info.value)


def test_build_rejects_bad_placement() -> None:
    with pytest.raises(SMPConfigError, match="'DDT'"):
        Topology.build(8, 2, 2, "DDT")


def test_direct_construction_rejects_alias() -> None:
    with pytest.raises(SMPConfigError, match="permutation"):
        Topology(8, 2, 2, "cluster")


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        Topology.build(8, 3)


@pytest.mark.parametrize("rank", [-1, 8, 100, True, 1.0, "0"])
def test_coords_rejects_out_of_range_rank(rank: object) -> None:
    topo = Topology.build(8, 2, 2)
    with pytest.raises(SMPConfigError, match="0..7"):
        topo.coords(rank)  # type: ignore[arg-type]


def test_rank_of_rejects_out_of_range_digit() -> None:
    topo = Topology.build(8, 2, 2)
    with pytest.raises(SMPConfigError, match="pp_rank"):
        topo.rank_of(2, 0, 0)
    with pytest.raises(SMPConfigError, match="tp_rank"):
        topo.rank_of(0, -1, 0)
    with pytest.raises(SMPConfigError, match="rdp_rank"):
        topo.rank_of(0, 0, 2)


def test_get_helpers_reject_out_of_range_coordinates() -> None:
    topo = Topology.build(8, 2, 2)
    with pytest.raises(SMPConfigError, match="dp_rank"):
        topo.get_pp_group(0, dp_rank=4)
    with pytest.raises(SMPConfigError, match="pp_rank"):
        topo.get_dp_group(0, pp_rank=2)
    with pytest.raises(SMPConfigError, match="rdp_rank"):
        topo.get_mp_group(0, rdp_rank=2)
    with pytest.raises(SMPConfigError, match="pp_rank"):
        topo.get_tp_group(0, pp_rank=5)
    with pytest.raises(SMPConfigError, match="tp_rank"):
        topo.get_rdp_group(0, tp_rank=2)


def test_unknown_axis_lists_valid_ones() -> None:
    topo = Topology.build(8, 2, 2)
    for call in (lambda: topo.group("ep", 0), lambda: topo.all_groups("ep"), lambda: topo.group_rank("ep", 0)):
        with pytest.raises(SMPConfigError, match="'ep'.*'pp', 'tp', 'rdp', 'dp', 'mp', 'world'"):
            call()


def test_topology_and_coords_are_frozen() -> None:
    topo = Topology.build(4, 2)
    with pytest.raises(AttributeError):
        topo.world_size = 8  # type: ignore[misc]
    assert topo.coords(3) == Coords(rank=3, pp_rank=1, tp_rank=0, rdp_rank=1, dp_rank=1, mp_rank=1)
