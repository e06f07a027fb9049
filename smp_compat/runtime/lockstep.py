"""Lockstep scheduling inside a tensor-parallel group of pipeline stages (pp > 1 and tp > 1).

The tp peers of one stage (same pp_rank and rdp_rank, different tp_rank) each run their own pipeline,
and the distributed layers inside their tasks issue collectives on the tp group. Collectives on a group
must be issued in the same order on every member, but each rank's scheduler picks its next task from
message *arrival* order, which differs between peers: left alone, one rank would pair microbatch 3's
all-reduce with its peer's microbatch 2 (same shapes, wrong numbers) or deadlock.

So tp_rank 0 of the stage (the *leader*) decides as it would alone and sends every decision to its
peers, naming the task by a key that is the same in every tp pipeline (see ``Task.key``); a *follower*
never chooses: at each hand-over it takes the leader's next decision, serves messages until that task is
runnable in its own pipeline, and runs it. Every peer then runs the same task segments in the same
order, hence the same collectives. A decision may carry a payload the task reads when it resumes (the
gradient replies a backward driver consumes), so what a task does on resuming cannot depend on
arrival order either. Deadlock-free because the leader's execution is causally consistent and each
follower's pipeline receives the same messages as the leader's, from peers that mirror theirs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from smp_compat.globalstate import state
from smp_compat.runtime.local_links import link_local_pairs
from smp_compat.runtime.tasks import Fatal
from smp_compat.runtime.messages import Message
from smp_compat.runtime.transport import Transport

if TYPE_CHECKING:
    from smp_compat.runtime.remote import Driver
    from smp_compat.runtime.tasks import Scheduler, Task

__all__ = ["Lockstep", "create_lockstep", "create_lockstep_groups", "lockstep_replies"]

DECISION = "lockstep"


def create_lockstep_groups(tp_groups: list[list[int]]) -> dict[tuple[int, int], Any]:
    """A process group per direction between each tp group's leader and each of its followers (every rank
    creates every group, in one order, as torch.distributed requires)."""
    groups = {}
    for members in tp_groups:
        leader = members[0]
        for follower in members[1:]:
            groups[(leader, follower)] = dist.new_group([leader, follower])
            groups[(follower, leader)] = dist.new_group([follower, leader])
    return link_local_pairs(groups)


class Lockstep:
    """This rank's side of its tp group's shared schedule: the leader publishes decisions, followers replay them."""

    def __init__(self, leader: bool, peers: list[int], transport: Any) -> None:
        self.leader = leader
        self.peers = peers  # the leader's followers; a follower's leader
        self.transport = transport
        self.decisions: collections.deque[tuple[tuple, Any]] = collections.deque()
        self.published = 0

    def choose(self, scheduler: Scheduler) -> Task | None:
        """The next task to run on this rank, or None to wait for a message."""
        if self.leader:
            task = scheduler._pick()
            if task is not None:
                task.shared = task.share() if task.share is not None else None
                self.published += 1
                for peer in self.peers:
                    self.transport.send(peer, DECISION, {"d": (task.key, task.shared)})
            return task
        root = scheduler.root
        if root is not None and root.runnable and isinstance(root.wakeup, Fatal):
            return root  # a task here failed: raise it now (the failure watch stops the peers), not at the leader's pace
        if not self.decisions:
            return None
        key, payload = self.decisions[0]
        task = _find(scheduler.tasks, key)
        if task is None:
            return None
        if task.accepts is not None:  # a backward driver: runnable once the replies the leader consumed are here
            if not task.accepts(payload):
                return None
            if not task.runnable:  # they came before it blocked
                scheduler.wake(task)
        elif not task.runnable:
            return None
        self.decisions.popleft()
        task.shared = payload
        return task

    def receive(self, message: Message) -> None:
        self.decisions.append(message.meta["d"])

    def describe(self) -> str:
        """For a timeout message: what a follower is waiting to replay."""
        if self.leader or not self.decisions:
            return ""
        return f"\n  (lockstep: next task to replay from the tp leader: {self.decisions[0][0]})"

    def close(self) -> None:
        self.transport.close()


def _find(tasks: list[Task], key: tuple) -> Task | None:
    for task in tasks:
        if task.key == key:
            return task
    return None


def create_lockstep(rank: int, scheduler: Scheduler) -> Lockstep | None:
    """With tp > 1, every rank creates the leader-follower channels and joins its tp group's lockstep."""
    topo = state.topology
    if topo.tp_size == 1:
        return None
    groups = create_lockstep_groups(topo.all_groups("tp"))
    members = topo.group("tp", rank)
    leader = rank == members[0]
    peers = [m for m in members if m != rank] if leader else [members[0]]
    lockstep = Lockstep(leader, peers, Transport(rank, peers, groups, state.device, scheduler.inbox))
    scheduler.lockstep = lockstep
    return lockstep


def lockstep_replies(task: Task, driver: Driver, rank: int) -> Callable[[Driver], list[tuple[int, int]]]:
    """A backward driver consumes the gradient replies its tp leader saw when it resumed the driver, not the
    ones that happened to arrive here: each batch is one local backward segment, with tp collectives.

    Returns what the driver calls for the requests to consume on each resume (none: block until the
    leader says which). The leader shares, and a follower accepts, through the task.
    """
    task.share = lambda: sorted(seq for r, seq in driver.outstanding if (r, seq) in driver.replies)
    task.accepts = lambda seqs: all((rank, seq) in driver.replies for seq in seqs)

    def ready(_: Driver) -> list[tuple[int, int]]:
        seqs, task.shared = task.shared or (), None
        return [(rank, seq) for seq in seqs]

    return ready
