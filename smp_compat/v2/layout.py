"""SMP v2's rank layout, as pure arithmetic: (world, local world, degrees) -> coordinates and group members.

``rank = ((rep * shard + s) * cp + c) * tp + t``: tensor parallelism innermost, then context parallelism, then
the data-parallel ranks, split into ``shard`` data shards per FSDP shard group times ``rep`` replicas. So
``dp_rank = rank // (tp * cp)``, as AWS's scripts compute it. ``hybrid_shard_degree`` counts context-parallel
ranks: a shard group holds ``H = shard * cp`` ranks. No torch here: the launcher's dry run and the tests use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from smp_compat.errors import SMPConfigError

__all__ = ["DIMS", "Coords", "Layout", "resolve_shard_degree"]

DIMS = ("rep", "shard", "cp", "tp")
"""The device mesh's dimension names, outermost first."""

_FULL = ("FULL_SHARD", "SHARD_GRAD_OP")
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


class Coords(NamedTuple):
    """A rank's place on the mesh."""

    rep: int
    shard: int
    cp: int
    tp: int


def resolve_shard_degree(
    hybrid_shard_degree: int, world_size: int, tp: int, local_world_size: int | None = None,
    sharding_strategy: Any = None,
) -> int:  # fmt: skip
    """The shard group's size (H, counting cp) that ``hybrid_shard_degree`` means (REF's rules).

    H >= 1 as given (1 = replicate only); H == 0 with tp > 1 = every data-parallel rank (world / tp); H == 0 with
    tp == 1 is native FSDP, decided by the script's ``sharding_strategy``: FULL_SHARD / SHARD_GRAD_OP (or none
    given) -> all ranks, HYBRID_SHARD / _HYBRID_SHARD_ZERO2 -> the ranks of one node, NO_SHARD -> 1.
    """
    if hybrid_shard_degree >= 1:
        return hybrid_shard_degree
    if tp > 1 or sharding_strategy is None:
        return world_size // tp
    name = getattr(sharding_strategy, "name", sharding_strategy)
    if name in _FULL:
        return world_size
    if name == "NO_SHARD":
        return 1
    if name in _HYBRID:
        node = local_world_size or world_size
        if node > world_size or world_size % node:
            raise SMPConfigError(
                f"sharding_strategy {name} shards within a node of {node} processes, which does not tile the "
                f"world of {world_size}; set hybrid_shard_degree explicitly (a divisor of {world_size})."
            )
        return node
    raise SMPConfigError(f"unknown sharding_strategy {sharding_strategy!r}; use a torch ShardingStrategy member.")


@dataclass(frozen=True)
class Layout:
    """The rank layout of one job; ``shard_degree`` is the resolved H (see :func:`resolve_shard_degree`)."""

    world_size: int
    tp: int
    cp: int
    shard_degree: int
    ep: int = 1

    def __post_init__(self) -> None:
        per = self.tp * self.shard_degree
        if min(self.tp, self.cp, self.shard_degree, self.ep) < 1 or self.world_size % per or self.shard_degree % self.cp:
            raise SMPConfigError(
                f"no SMP v2 layout has world {self.world_size}, tp {self.tp}, cp {self.cp}, shard group "
                f"{self.shard_degree}: tp x shard group must divide the world and cp the shard group."
            )

    @property
    def rep(self) -> int:
        """Replicas of each shard (the HSDP replicate dimension)."""
        return self.world_size // (self.tp * self.shard_degree)

    @property
    def shard(self) -> int:
        """Data shards per shard group (the HSDP shard dimension, without cp)."""
        return self.shard_degree // self.cp

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp * self.cp)

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """Sizes of :data:`DIMS`."""
        return (self.rep, self.shard, self.cp, self.tp)

    def coords(self, rank: int) -> Coords:
        """``rank`` -> (rep, shard, cp, tp) coordinates."""
        self._check_rank(rank)
        rank, t = divmod(rank, self.tp)
        rank, c = divmod(rank, self.cp)
        r, s = divmod(rank, self.shard)
        return Coords(r, s, c, t)

    def rank_of(self, coords: Coords) -> int:
        return ((coords.rep * self.shard + coords.shard) * self.cp + coords.cp) * self.tp + coords.tp

    def dp_rank(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // (self.tp * self.cp)

    def _members(self, rank: int, varying: tuple[str, ...]) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except those named in ``varying``."""
        base = self.coords(rank)
        return [r for r in range(self.world_size)
                if all(a == b for name, a, b in zip(DIMS, self.coords(r), base) if name not in varying)]  # fmt: skip

    def tp_group(self, rank: int) -> list[int]:
        return self._members(rank, ("tp",))

    def cp_group(self, rank: int) -> list[int]:
        return self._members(rank, ("cp",))

    def shard_group(self, rank: int) -> list[int]:
        """The FSDP shard group: H ranks, ``shard`` data shards x ``cp``, one tp coordinate."""
        return self._members(rank, ("shard", "cp"))

    def replicate_group(self, rank: int) -> list[int]:
        """Ranks that hold the same shard (same shard, cp and tp coordinates)."""
        return self._members(rank, ("rep",))

    def rep_rank_group(self, rank: int) -> list[int]:
        """All ranks of this rank's replica (same rep coordinate): SMP's ``rep_rank_process_group``."""
        return self._members(rank, ("shard", "cp", "tp"))

    def dp_group(self, rank: int) -> list[int]:
        """Ranks with the same model slice and different data: same cp and tp coordinates."""
        return self._members(rank, ("rep", "shard"))

    def all_groups(self, group_of: Callable[[int], list[int]]) -> list[list[int]]:
        """Every distinct group of one kind, ordered by first member (``layout.all_groups(layout.tp_group)``)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(group_of(r)), None)
        return [list(g) for g in seen]

    def rank_table(self) -> list[str]:
        """One line per rank for ``--dry-run``: coordinates and group members."""
        lines = [f"SMP v2 layout: world {self.world_size} = rep {self.rep} x shard {self.shard} x cp {self.cp} x "
                 f"tp {self.tp} (hybrid shard group {self.shard_degree} ranks, ep {self.ep})"]  # fmt: skip
        for r in range(self.world_size):
            c = self.coords(r)
            lines.append(
                f"  rank {r}: tp_rank {c.tp} cp_rank {c.cp} dp_rank {self.dp_rank(r)} rep_rank {c.rep} | "
                f"tp {self.tp_group(r)} cp {self.cp_group(r)} shard {self.shard_group(r)} "
                f"replicas {self.replicate_group(r)}"
            )
        return lines

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise SMPConfigError(f"rank {rank} is outside the world of {self.world_size} processes.")
