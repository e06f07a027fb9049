"""Tests for manual partitioning (smp.partition, smp.set_partition, manual_plan) and plan validation."""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import smp_compat
from smp_compat.config import resolve_config
from smp_compat.errors import PartitionError, SMPNotInitializedError
from smp_compat.partitioning import (
    PartitionPlan,
    clear_records,
    manual_plan,
    partition,
    set_partition,
    shared_groups,
    state_modules,
    validate_plan,
)
from smp_compat.globalstate import state

@pytest.fixture(autouse=True)
def module_init() -> Iterator[Callable[..., None]]:
    """``nn.Module.__init__`` as this test found it: torch.compile (other test files) installs its own
    patch once per process, so an import-time copy would depend on which tests ran first."""
    clear_records()
    before = nn.Module.__init__
    yield before
    clear_records()
    assert nn.Module.__init__ is before, "a partition context leaked its nn.Module.__init__ patch"


@pytest.fixture
def smp_cfg(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Pretend smp.init ran with this config in a world of pp ranks (one process can't init pp > 1)."""

    def configure(pp: int = 2, auto_partition: bool = False, default_partition: int | None = 0) -> None:
        params: dict[str, object] = {"pipeline_parallel_degree": pp, "auto_partition": auto_partition}
        if default_partition is not None:
            params["default_partition"] = default_partition
        monkeypatch.setattr(state, "cfg", resolve_config(params, environ={}))
        monkeypatch.setattr(state, "initialized", True)

    return configure


class Nested(nn.Module):
    """Exercises nesting: the innermost smp.partition block wins for each module created."""

    def __init__(self) -> None:
        super().__init__()
        self.outside = nn.Linear(2, 2)
        with partition(1):
            self.one = nn.Linear(2, 2)
            with partition(3):
                self.three = nn.Linear(2, 2)
                self.block = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            self.back_to_one = nn.Linear(2, 2)
        with partition(2):
            self.two = nn.Sequential(nn.Linear(2, 2))


def test_nested_contexts_innermost_wins(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=4, default_partition=0)
    model = Nested()
    plan = manual_plan(model, 4, 0)
    assert plan.assignment == {
        "outside": 0,
        "one": 1,
        "three": 3,
        "block.0": 3,
        "back_to_one": 1,
        "two.0": 2,
    }
    assert plan.method == "manual" and plan.pp_size == 4
    validate_plan(model, plan)


def test_modules_outside_any_context_go_to_default_partition(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=4, default_partition=2)
    model = Nested()
    # A container and its child created outside any block, added after the fact, also take the default.
    model.late = nn.Sequential(nn.Linear(2, 2))
    plan = manual_plan(model, 4, 2)
    assert plan.rank_of("outside") == 2
    assert plan.rank_of("late.0") == 2
    assert plan.rank_of("one") == 1
    assert plan.rank_of("late") is None  # parameter-free: runs on its caller's rank


def test_default_partition_none_lists_unassigned_modules(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=4)
    model = Nested()
    with pytest.raises(PartitionError, match=r"'outside'.*default_partition"):
        manual_plan(model, 4, None)


def test_context_restores_module_init_even_after_an_error(
    smp_cfg: Callable[..., None], module_init: Callable[..., None]
) -> None:
    smp_cfg(pp=2)
    with pytest.raises(RuntimeError, match="boom"), partition(1), partition(0):
        assert nn.Module.__init__ is not module_init
        raise RuntimeError("boom")
    assert nn.Module.__init__ is module_init
    layer = nn.Linear(2, 2)
    assert manual_plan(layer, 2, 0).assignment == {"": 0}


def test_modules_created_in_another_thread_are_not_recorded(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=2)
    made: list[nn.Module] = []
    with partition(1):
        thread = threading.Thread(target=lambda: made.append(nn.Linear(2, 2)))
        thread.start()
        thread.join()
        mine = nn.Linear(2, 2)
    holder = nn.Module()
    holder.theirs, holder.mine = made[0], mine
    assert manual_plan(holder, 2, 0).assignment == {"theirs": 0, "mine": 1}


def test_set_partition_recurse_and_override(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=4)
    model = Nested()
    set_partition(model.block, 1)  # recurse: block.0 moves too, overriding its creation record (3)
    set_partition(model.two, 3, recurse=False)  # only the container: two.0 keeps 2
    set_partition(model.outside, 2)
    plan = manual_plan(model, 4, 0)
    assert plan.rank_of("block.0") == 1
    assert plan.rank_of("two.0") == 2
    assert plan.rank_of("outside") == 2
    assert plan.rank_of("three") == 3


def test_set_partition_on_container_recurse_false_leaves_children(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=2)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    set_partition(model, 1, recurse=False)
    assert manual_plan(model, 2, 0).assignment == {"0": 0, "1": 0}
    set_partition(model, 1)
    assert manual_plan(model, 2, 0).assignment == {"0": 1, "1": 1}


def test_set_partition_after_partitioning_is_an_error(
    smp_cfg: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    smp_cfg(pp=2)
    monkeypatch.setattr(state, "model", types.SimpleNamespace(partitioned=True))
    with pytest.raises(PartitionError, match="after the model was partitioned"):
        set_partition(nn.Linear(2, 2), 1)


def test_set_partition_before_partitioning_is_allowed(
    smp_cfg: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    smp_cfg(pp=2)
    monkeypatch.setattr(state, "model", types.SimpleNamespace(partitioned=False))
    layer = nn.Linear(2, 2)
    set_partition(layer, 1)
    holder = nn.Sequential(layer)
    assert manual_plan(holder, 2, 0).assignment == {"0": 1}


@pytest.mark.parametrize("index", [2, -1, True, 1.0, "1"])
def test_out_of_range_or_bad_index(
    smp_cfg: Callable[..., None], index: object, module_init: Callable[..., None]
) -> None:
    smp_cfg(pp=2)
    with pytest.raises(PartitionError, match=r"from 0 to 1"), partition(index):  # type: ignore[arg-type]
        pass
    with pytest.raises(PartitionError, match=r"from 0 to 1"):
        set_partition(nn.Linear(2, 2), index)  # type: ignore[arg-type]
    assert nn.Module.__init__ is module_init


def test_set_partition_rejects_non_modules(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=2)
    with pytest.raises(PartitionError, match=r"expects an nn.Module, got Tensor"):
        set_partition(torch.zeros(2), 1)  # type: ignore[arg-type]


def test_auto_partition_makes_contexts_no_ops_and_set_partition_warns(
    smp_cfg: Callable[..., None], module_init: Callable[..., None]
) -> None:
    smp_cfg(pp=2, auto_partition=True, default_partition=None)
    with partition(5):  # not even validated: SMP ignores the block under auto_partition
        assert nn.Module.__init__ is module_init
        layer = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="ignored because auto_partition is True"):
        set_partition(layer, 1)
    assert manual_plan(nn.Sequential(layer), 2, 0).assignment == {"0": 0}


def test_contexts_are_no_ops_before_init(module_init: Callable[..., None]) -> None:
    with partition(7):
        assert nn.Module.__init__ is module_init
        layer = nn.Linear(2, 2)
    assert manual_plan(nn.Sequential(layer), 2, 1).assignment == {"0": 1}
    with pytest.raises(SMPNotInitializedError, match=r"smp.set_partition"):
        set_partition(layer, 0)


def test_with_real_smp_init() -> None:
    smp_compat.init({"auto_partition": False, "default_partition": 0})
    with partition(0):
        layer = nn.Linear(2, 2)
    with pytest.raises(PartitionError, match="from 0 to 0"), partition(1):
        pass
    assert manual_plan(nn.Sequential(layer), 1, 0).assignment == {"0": 0}


class Tied(nn.Module):
    def __init__(self, head_partition: int) -> None:
        super().__init__()
        with partition(0):
            self.embed = nn.Embedding(10, 4)
        with partition(head_partition):
            self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_shared_parameters_split_across_partitions_is_an_error(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=2)
    model = Tied(head_partition=1)
    with pytest.raises(PartitionError) as info:
        manual_plan(model, 2, 0)
    message = str(info.value)
    assert "'embed' on rank 0" in message and "'head' on rank 1" in message
    assert "'embed.weight'" in message and "together" in message


def test_shared_parameters_together_are_fine(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=2)
    model = Tied(head_partition=0)
    plan = manual_plan(model, 2, 1)
    assert plan.assignment == {"embed": 0, "head": 0}
    assert plan.param_bytes_per_rank(model) == [10 * 4 * 4, 0]  # the tied weight counts once


class RootWithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.body = nn.Linear(2, 2)


def test_root_state_is_forced_to_partition_zero(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=2)
    with partition(1):
        model = RootWithState()
    with pytest.warns(UserWarning, match="root module was placed on partition 1"):
        plan = manual_plan(model, 2, 0)
    assert plan.assignment == {"": 0, "body": 1}
    validate_plan(model, plan)


def test_root_on_partition_zero_does_not_warn(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=2)
    model = RootWithState()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manual_plan(model, 2, 0).assignment == {"": 0, "body": 0}


def test_recorded_rank_beyond_plan_pp_size_is_an_error(smp_cfg: Callable[..., None]) -> None:
    smp_cfg(pp=4)
    model = Nested()
    with pytest.raises(PartitionError, match=r"'three' is placed on partition 3.*degree is 2"):
        manual_plan(model, 2, 0)


# --- state modules, shared groups, validate_plan ------------------------------------------------------


class BufferOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(3))
        self.register_buffer("nothing", None)


def test_state_modules_are_the_modules_that_own_tensors() -> None:
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.ReLU(), BufferOnly(), nn.Sequential(nn.Dropout()))
    assert state_modules(model) == ["0", "2"]
    empty = nn.Module()
    empty.register_parameter("p", None)
    assert state_modules(empty) == []


def test_shared_groups_are_connected_components() -> None:
    a, b, c, d = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    c.bias = b.bias
    model = nn.Sequential(a, d, b, c)
    assert shared_groups(model) == [["0", "2", "3"]]
    e = nn.Linear(2, 2)
    e.register_buffer("buf", torch.zeros(1))
    f = nn.Linear(2, 2)
    f.register_buffer("buf", e.buf)
    model2 = nn.Sequential(nn.Linear(2, 2), f, e)
    assert shared_groups(model2) == [["1", "2"]]


def _tied_plan(**changes: object) -> tuple[nn.Module, PartitionPlan]:
    model = nn.Module()
    model.embed = nn.Embedding(4, 2)
    model.mid = nn.Linear(2, 2)
    model.head = nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    assignment = {"embed": 0, "mid": 1, "head": 0}
    assignment.update(changes)  # type: ignore[arg-type]
    return model, PartitionPlan(assignment=assignment, pp_size=2, method="manual")


def test_validate_plan_accepts_a_good_plan() -> None:
    validate_plan(*_tied_plan())


def test_validate_plan_rejects_split_shared_group() -> None:
    model, plan = _tied_plan(head=1)
    with pytest.raises(PartitionError, match=r"'embed' on rank 0, 'head' on rank 1 share .*'embed.weight'.*together"):
        validate_plan(model, plan)


def test_validate_plan_rejects_out_of_range_rank() -> None:
    model, plan = _tied_plan(mid=2)
    with pytest.raises(PartitionError, match=r"'mid'.*\[2\].*\[0, 1\]"):
        validate_plan(model, plan)


def test_validate_plan_rejects_missing_and_unknown_modules() -> None:
    model, plan = _tied_plan()
    del plan.assignment["mid"]
    with pytest.raises(PartitionError, match="no rank to 'mid'"):
        validate_plan(model, plan)
    model, plan = _tied_plan(ghost=1)
    with pytest.raises(PartitionError, match="does not have: 'ghost'"):
        validate_plan(model, plan)


def test_validate_plan_rejects_root_off_rank_zero() -> None:
    model = RootWithState()
    plan = PartitionPlan(assignment={"": 1, "body": 1}, pp_size=2, method="manual")
    with pytest.raises(PartitionError, match="root module's own parameters/buffers are assigned to rank 1"):
        validate_plan(model, plan)
