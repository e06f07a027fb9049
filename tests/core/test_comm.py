"""Communication helpers and rank/size/group helpers on real ranks (SMP_REFERENCE §2.8, §2.9, §3)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import smp_compat as smp
from smp_compat.errors import DDPNotEnabledError, SMPConfigError, SMPNotInitializedError
from smp_compat.globalstate import state
from smp_compat.testing import run_ranks
from smp_compat.topology import Topology

__all__: list[str] = []

# SMP_REFERENCE §3 worked example A, cut to 4 ranks with pp = 2 (no TP): rank -> (pp_rank, dp_rank).
EXPECTED_COORDS = {
    "cluster": {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)},
    "spread": {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)},
}
EXPECTED_GROUPS = {  # (DP group, PP group) of each rank, ordered by group rank
    "cluster": {0: ([0, 2], [0, 1]), 1: ([1, 3], [0, 1]), 2: ([0, 2], [2, 3]), 3: ([1, 3], [2, 3])},
    "spread": {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])},
}



def _init_pp2(placement: str, ddp: bool = True) -> None:
    smp.init({"pipeline_parallel_degree": 2, "ddp": ddp, "placement_strategy": placement})


# ---------------------------------------------------------------------------- rank functions (forked)


def _layout(placement: str) -> dict[str, Any]:
    _init_pp2(placement)
    return {
        "rank": smp.rank(), "size": smp.size(), "local_rank": smp.local_rank(), "local_size": smp.local_size(),
        "pp": (smp.pp_rank(), smp.pp_size()), "dp": (smp.dp_rank(), smp.dp_size()),
        "tp": (smp.tp_rank(), smp.tp_size()), "rdp": (smp.rdp_rank(), smp.rdp_size()),
        "mp": (smp.mp_rank(), smp.mp_size()), "microbatches": smp.num_microbatches(),
        "dp_group": smp.get_dp_group(), "pp_group": smp.get_pp_group(), "mp_group": smp.get_mp_group(),
        "tp_group": smp.get_tp_group(), "rdp_group": smp.get_rdp_group(),
        "dp_group_of_pp1": smp.get_dp_group(pp_rank=1), "pp_group_of_dp1": smp.get_pp_group(dp_rank=1),
        "torch_dp_ranks": dist.get_process_group_ranks(smp.get_dp_process_group()),
        "torch_pp_ranks": dist.get_process_group_ranks(smp.get_pp_process_group()),
        "torch_world_ranks": dist.get_process_group_ranks(smp.get_world_process_group()),
    }  # fmt: skip


def _exchange(first: bool, peer: int, rank_type: smp.RankType, payload: Any) -> Any:
    """Blocking pairwise swap; one side sends first so that the two sends cannot wait on each other."""
    if first:
        smp.send(payload, peer, rank_type)
        return smp.recv_from(peer, rank_type)
    received = smp.recv_from(peer, rank_type)
    smp.send(payload, peer, rank_type)
    return received


def _point_to_point(placement: str) -> dict[str, Any]:
    _init_pp2(placement)
    me, got = smp.rank(), {}
    if me == 0:
        smp.broadcast({"from": 0, "tensor": torch.arange(3)}, smp.WORLD)
    else:
        got["world_bcast"] = smp.recv_from(0, smp.RankType.WORLD_RANK)
    if smp.dp_rank() == 0:
        smp.broadcast(("dp", me), smp.DP_GROUP)
    else:
        got["dp_bcast"] = smp.recv_from(0, smp.RankType.DP_RANK)
    if smp.pp_rank() == 0:
        smp.broadcast(("pp", me), smp.CommGroup.PP_GROUP)
    else:
        got["pp_bcast"] = smp.recv_from(0, smp.RankType.PP_RANK)
    got["dp_swap"] = _exchange(smp.dp_rank() == 0, 1 - smp.dp_rank(), smp.RankType.DP_RANK, ("dp_swap", me))
    got["pp_swap"] = _exchange(smp.pp_rank() == 0, 1 - smp.pp_rank(), smp.RankType.PP_RANK, ("pp_swap", me))
    # A ring over WORLD_RANK: even ranks send first, odd ranks receive first.
    if me % 2 == 0:
        smp.send(("ring", me), (me + 1) % 4, smp.RankType.WORLD_RANK)
        got["ring"] = smp.recv_from((me - 1) % 4, smp.RankType.WORLD_RANK)
    else:
        got["ring"] = smp.recv_from((me - 1) % 4, smp.RankType.WORLD_RANK)
        smp.send(("ring", me), (me + 1) % 4, smp.RankType.WORLD_RANK)
    smp.barrier()
    return me, got


def _gathers(placement: str) -> dict[str, Any]:
    _init_pp2(placement)
    me = smp.rank()
    return {
        "rank": me,
        "world": smp.allgather(me, smp.WORLD),
        "dp": smp.allgather(me, smp.DP_GROUP),
        "pp": smp.allgather(me, smp.PP_GROUP),
        "mp": smp.allgather(me, smp.MP_GROUP),
        "rdp": smp.allgather(me, smp.RDP_GROUP),
        "tp": smp.allgather(me, smp.TP_GROUP),
        "by_int_code": smp.allgather(me, 4),  # 4 is DP_GROUP's code value
        "gather_dp_to_1": smp.gather({"r": me}, smp.DP_GROUP, rank=1),
    }


class _PermutedTopology(Topology):
    """Lists PP groups in reverse, so SMP group order differs from torch's sorted order.

    With tp = 1 (all smp_compat supports) every SMP group happens to be sorted by global rank, for every
    placement; this is the only way to check that allgather and RankType follow SMP's order, not torch's.
    """

    def group(self, axis: str, rank: int) -> list[int]:
        members = super().group(axis, rank)
        return members[::-1] if axis == "pp" else members


def _permuted_order() -> dict[str, Any]:
    _init_pp2("spread")
    t = state.topology
    state.topology = _PermutedTopology(t.world_size, t.pp_size, t.tp_size, t.placement)
    me = smp.rank()
    members = state.topology.group("pp", me)
    first = members[0] == me
    swapped = _exchange(first, 1 if first else 0, smp.RankType.PP_RANK, me)
    return {"rank": me, "members": members, "allgather": smp.allgather(me, smp.PP_GROUP), "swapped": swapped}


DELAY = 0.5


def _barrier_waits() -> dict[str, float]:
    """Time spent in barriers when one rank arrives DELAY late (cluster: PP groups [0,1] and [2,3])."""
    _init_pp2("cluster")
    smp.barrier()
    me, waits = smp.rank(), {}
    if me == 3:
        time.sleep(DELAY)
    start = time.monotonic()
    smp.pp_barrier()
    waits["pp"] = time.monotonic() - start
    smp.barrier()
    if me == 0:
        time.sleep(DELAY)
    start = time.monotonic()
    smp.barrier(smp.WORLD)
    waits["world"] = time.monotonic() - start
    for shorthand in (smp.dp_barrier, smp.mp_barrier, smp.tp_barrier, smp.rdp_barrier, smp.pp_barrier):
        shorthand()
    return waits


def _process_groups_without_ddp() -> list[str]:
    smp.init({"pipeline_parallel_degree": 2})
    refused = []
    for getter in (
        smp.get_world_process_group, smp.get_pp_process_group, smp.get_dp_process_group,
        smp.get_mp_process_group, smp.get_tp_process_group, smp.get_rdp_process_group,
    ):  # fmt: skip
        try:
            getter()
        except DDPNotEnabledError as exc:
            assert '"ddp": True' in str(exc), str(exc)
            refused.append(getter.__name__)
    return refused


# ---------------------------------------------------------------------------- tests: ranks and groups


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_rank_helpers_follow_the_topology_on_4_ranks(placement: str) -> None:
    results = run_ranks(_layout, 4, placement, timeout=30)
    for rank, r in enumerate(results):
        pp, dp = EXPECTED_COORDS[placement][rank]
        dp_group, pp_group = EXPECTED_GROUPS[placement][rank]
        assert r["rank"] == r["local_rank"] == rank
        assert r["size"] == r["local_size"] == 4
        assert r["pp"] == (pp, 2) and r["dp"] == (dp, 2)
        assert r["tp"] == (0, 1) and r["rdp"] == (dp, 2) and r["mp"] == (pp, 2)
        assert r["microbatches"] == 1
        assert r["dp_group"] == dp_group and r["pp_group"] == pp_group
        assert r["mp_group"] == pp_group and r["rdp_group"] == dp_group and r["tp_group"] == [rank]
        assert r["dp_group_of_pp1"] == EXPECTED_GROUPS[placement][pp_group[1]][0]
        assert r["pp_group_of_dp1"] == EXPECTED_GROUPS[placement][dp_group[1]][1]
        assert r["torch_dp_ranks"] == dp_group and r["torch_pp_ranks"] == pp_group
        assert r["torch_world_ranks"] == [0, 1, 2, 3]


_SIZES = [smp.size, smp.local_size, smp.pp_size, smp.tp_size, smp.dp_size, smp.rdp_size, smp.mp_size]
_NEED_INIT = [
    smp.rank, smp.local_rank, smp.pp_rank, smp.tp_rank, smp.dp_rank, smp.rdp_rank, smp.mp_rank,
    smp.num_microbatches, smp.get_pp_group, smp.get_dp_group, smp.get_mp_group, smp.get_tp_group,
    smp.get_rdp_group, smp.get_world_process_group, smp.get_dp_process_group, smp.get_pp_process_group,
    smp.barrier, smp.dp_barrier,
]  # fmt: skip


@pytest.mark.parametrize("fn", _SIZES, ids=lambda f: f.__name__)
def test_sizes_are_1_before_init(fn: Any) -> None:
    assert not smp.is_initialized()
    assert fn() == 1


@pytest.mark.parametrize("fn", _NEED_INIT, ids=lambda f: f.__name__)
def test_rank_functions_raise_before_init(fn: Any) -> None:
    with pytest.raises(SMPNotInitializedError, match=r"smp\.init\(\)"):
        fn()


def test_communication_raises_before_init() -> None:
    with pytest.raises(SMPNotInitializedError):
        smp.allgather(1, smp.WORLD)
    with pytest.raises(SMPNotInitializedError):
        smp.send(1, 0, smp.RankType.WORLD_RANK)


# ---------------------------------------------------------------------------- tests: communication


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_broadcast_and_send_use_the_group_numbering_of_the_rank_type(placement: str) -> None:
    for rank, got in run_ranks(_point_to_point, 4, placement, timeout=30):
        dp_group, pp_group = EXPECTED_GROUPS[placement][rank]
        if rank == 0:
            assert "world_bcast" not in got  # one-sided: the sender receives nothing
        else:
            assert got["world_bcast"]["from"] == 0
            torch.testing.assert_close(got["world_bcast"]["tensor"], torch.arange(3))
        assert got.get("dp_bcast", ("dp", dp_group[0])) == ("dp", dp_group[0])
        assert ("dp_bcast" in got) == (rank != dp_group[0])
        assert got.get("pp_bcast", ("pp", pp_group[0])) == ("pp", pp_group[0])
        assert ("pp_bcast" in got) == (rank != pp_group[0])
        assert got["dp_swap"] == ("dp_swap", next(r for r in dp_group if r != rank))
        assert got["pp_swap"] == ("pp_swap", next(r for r in pp_group if r != rank))
        assert got["ring"] == ("ring", (rank - 1) % 4)


@pytest.mark.parametrize("placement", ["cluster", "spread"])
def test_allgather_is_ordered_by_group_rank(placement: str) -> None:
    for r in run_ranks(_gathers, 4, placement, timeout=30):
        dp_group, pp_group = EXPECTED_GROUPS[placement][r["rank"]]
        assert r["world"] == [0, 1, 2, 3]
        assert r["dp"] == r["by_int_code"] == r["rdp"] == dp_group
        assert r["pp"] == r["mp"] == pp_group
        assert r["tp"] == [r["rank"]]
        if r["rank"] == dp_group[1]:
            assert r["gather_dp_to_1"] == [{"r": m} for m in dp_group]
        else:
            assert r["gather_dp_to_1"] is None


def test_allgather_and_rank_type_follow_smp_order_where_torch_order_differs() -> None:
    for r in run_ranks(_permuted_order, 4, timeout=30):
        members = r["members"]
        assert members == sorted(members, reverse=True)  # the permuted layout really is out of torch's order
        assert r["allgather"] == members  # entry i came from SMP group rank i
        assert r["swapped"] == next(m for m in members if m != r["rank"])


def test_barriers_wait_for_their_group_only() -> None:
    waits = run_ranks(_barrier_waits, 4, timeout=30)
    assert waits[2]["pp"] >= 0.75 * DELAY  # rank 2 shares a PP group with the late rank 3
    assert waits[0]["pp"] < 0.5 * DELAY and waits[1]["pp"] < 0.5 * DELAY  # the other PP group does not wait
    for rank in (1, 2, 3):
        assert waits[rank]["world"] >= 0.75 * DELAY  # everyone waits for the late rank 0


def test_process_groups_need_ddp() -> None:
    names = ["get_world_process_group", "get_pp_process_group", "get_dp_process_group",
             "get_mp_process_group", "get_tp_process_group", "get_rdp_process_group"]  # fmt: skip
    assert run_ranks(_process_groups_without_ddp, 2, timeout=30) == [names, names]


def test_process_groups_in_a_world_of_one() -> None:
    smp.init({})
    with pytest.raises(DDPNotEnabledError):
        smp.get_dp_process_group()
    smp.reset()
    smp.init({"ddp": True})
    assert dist.get_world_size(smp.get_dp_process_group()) == 1
    assert dist.get_process_group_ranks(smp.get_world_process_group()) == [0]


def test_helpers_in_a_world_of_one_need_no_process_group() -> None:
    smp.init({})
    smp.broadcast("nobody listens", smp.WORLD)  # no other member: nothing to send
    assert smp.allgather({"a": 1}, smp.DP_GROUP) == [{"a": 1}]
    assert smp.gather(5, smp.WORLD) == [5]
    smp.barrier()
    smp.pp_barrier()


@pytest.mark.parametrize(
    "call",
    [
        lambda: smp.barrier(9),
        lambda: smp.barrier("dp"),
        lambda: smp.allgather(1, 42),
        lambda: smp.broadcast(1, -1),
        lambda: smp.send(1, 0, 17),
        lambda: smp.recv_from(0, "world"),
        lambda: smp.gather(1, None),
    ],
    ids=["barrier-int", "barrier-str", "allgather", "broadcast", "send-rank-type", "recv-rank-type", "gather"],
)
def test_bad_group_or_rank_type_is_a_config_error(call: Any) -> None:
    smp.init({})
    with pytest.raises(SMPConfigError, match=r"is not a (CommGroup|RankType); use one of smp\."):
        call()


def test_peer_rank_out_of_range_is_a_config_error() -> None:
    smp.init({})
    with pytest.raises(SMPConfigError, match=r"rank 1 is out of range for DP_RANK \(group of 1\)"):
        smp.send("x", 1, smp.RankType.DP_RANK)
    with pytest.raises(SMPConfigError, match="out of range"):
        smp.recv_from(-1, smp.RankType.WORLD_RANK)


def test_gather_destination_out_of_range_is_a_config_error() -> None:
    smp.init({})
    with pytest.raises(SMPConfigError, match=r"smp.gather rank 3 is out of range for WORLD \(group of 1\)"):
        smp.gather(1, smp.WORLD, rank=3)
