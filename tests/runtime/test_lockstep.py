"""Lockstep's choice of the next task, in one process: the leader publishes, a follower only replays."""

from __future__ import annotations

from typing import Any

import torch

from smp_compat.runtime.lockstep import DECISION, Lockstep, lockstep_replies
from smp_compat.runtime.remote import Driver
from smp_compat.runtime.tasks import FORWARD, SERVE_BACKWARD, Fatal, Scheduler, Task
from smp_compat.runtime.messages import Message


class _Sent:
    """Stands in for the transport: records what the leader sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict]] = []

    def send(self, dst: int, kind: str, meta: dict[str, Any]) -> None:
        self.sent.append((dst, kind, meta))


def _task(name: str, priority: tuple, runnable: bool = True) -> Task:
    task = Task(name, None, priority)
    task.runnable = runnable
    return task


def _scheduler(*tasks: Task) -> Scheduler:
    scheduler = Scheduler(lambda message: None, rank=0, device=torch.device("cpu"))
    scheduler.tasks.extend(tasks)
    return scheduler


def _decide(lockstep: Lockstep, key: tuple, payload: Any = None) -> None:
    lockstep.receive(Message(DECISION, 0, {"d": (key, payload)}))


def test_leader_picks_by_priority_and_tells_every_follower() -> None:
    sent = _Sent()
    leader = Lockstep(True, [1, 2], sent)
    mb0, served = _task("microbatch-0", (FORWARD, 0)), _task("serve-bwd", (SERVE_BACKWARD, 0))
    served.key = ("serve", 1, 0)
    assert leader.choose(_scheduler(served, mb0)) is mb0
    assert sent.sent == [(1, DECISION, {"d": (("microbatch-0",), None)}), (2, DECISION, {"d": (("microbatch-0",), None)})]


def test_follower_runs_only_the_leaders_decision_in_order() -> None:
    follower = Lockstep(False, [0], _Sent())
    mb0, mb1 = _task("microbatch-0", (FORWARD, 0), runnable=False), _task("microbatch-1", (FORWARD, 1))
    scheduler = _scheduler(mb0, mb1)
    assert follower.choose(scheduler) is None  # mb1 is runnable, but nothing was decided yet
    _decide(follower, ("microbatch-0",))
    _decide(follower, ("microbatch-1",))
    assert follower.choose(scheduler) is None  # the leader ran mb0 first: wait until it is runnable here
    mb0.runnable = True
    assert follower.choose(scheduler) is mb0
    mb0.runnable = False
    assert follower.choose(scheduler) is mb1 and not follower.decisions


def test_follower_waits_for_a_task_that_has_not_arrived_yet() -> None:
    follower = Lockstep(False, [0], _Sent())
    scheduler = _scheduler()
    _decide(follower, ("serve", 0, 3))
    assert follower.choose(scheduler) is None and "('serve', 0, 3)" in follower.describe()
    served = _task("serve-fwd-mb1", (1, 0))
    served.key = ("serve", 0, 3)
    scheduler.tasks.append(served)
    assert follower.choose(scheduler) is served


def test_backward_driver_consumes_exactly_the_replies_the_leader_consumed() -> None:
    rank = 5
    leader_task, follower_task = _task("microbatch-0", (4, 0), runnable=False), _task("microbatch-0", (4, 0), False)
    leader_driver, follower_driver = Driver(leader_task), Driver(follower_task)
    for driver in (leader_driver, follower_driver):
        driver.outstanding.update({(rank, 7), (rank, 9)})
    leader_ready = lockstep_replies(leader_task, leader_driver, rank)
    follower_ready = lockstep_replies(follower_task, follower_driver, rank)
    sent = _Sent()
    leader, follower = Lockstep(True, [1], sent), Lockstep(False, [0], _Sent())

    leader_driver.replies[(rank, 9)] = "reply"  # only request 9 has answered on the leader
    leader_task.runnable = True
    assert leader.choose(_scheduler(leader_task)) is leader_task
    assert leader_ready(leader_driver) == [(rank, 9)]
    follower.receive(Message(DECISION, 0, sent.sent[0][2]))

    scheduler = _scheduler(follower_task)
    follower_driver.replies[(rank, 7)] = "reply"  # here 7 arrived first: not what the leader consumed
    assert follower.choose(scheduler) is None
    follower_driver.replies[(rank, 9)] = "reply"  # arrived before the driver blocked again: not runnable
    assert follower.choose(scheduler) is follower_task  # woken for the leader's decision
    assert follower_ready(follower_driver) == [(rank, 9)]  # 7 waits for a later decision
    assert follower_ready(follower_driver) == []  # and never taken without one


def test_follower_raises_its_own_failure_without_waiting_for_the_leader() -> None:
    follower = Lockstep(False, [0], _Sent())
    scheduler = _scheduler()
    root = scheduler.adopt("step")
    assert follower.choose(scheduler) is None
    scheduler.wake(root, Fatal(ValueError("boom")))
    assert follower.choose(scheduler) is root
