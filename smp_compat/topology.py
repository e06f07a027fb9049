"""Pure rank arithmetic: every rank's coordinates and every group's members, from SMP's placement rule."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from itertools import permutations

from smp_compat.errors import SMPConfigError

__all__ = [
    "AXES",
    "PLACEMENT_ALIASES",
    "VALID_PLACEMENTS",
    "Coords",
    "Topology",
    "placement_letters",
]

AXES: tuple[str, ...] = ("pp", "tp", "rdp", "dp", "mp", "world")
"""Group axis names; ``world`` is the whole job."""

PLACEMENT_ALIASES: dict[str, str] = {"cluster": "DPT", "spread": "TPD"}
"""SMP's named strategies and the letter strings they stand for (SMP_REFERENCE §3)."""

_PERMUTATIONS: tuple[str, ...] = tuple("".join(p) for p in permutations(("P", "D", "T")))

VALID_PLACEMENTS: tuple[str, ...] = (*PLACEMENT_ALIASES, *_PERMUTATIONS)
"""Every value ``placement_strategy`` accepts."""


def placement_letters(placement_strategy: str) -> str:
    """Map a ``placement_strategy`` value to its three letters, so layout code handles one form only."""
    if isinstance(placement_strategy, str):
        if placement_strategy in PLACEMENT_ALIASES:
            return PLACEMENT_ALIASES[placement_strategy]
        if placement_strategy in _PERMUTATIONS:
            return placement_strategy
    raise SMPConfigError(
        f"placement_strategy {placement_strategy!r} is not valid. Use one of "
        f"{', '.join(repr(v) for v in VALID_PLACEMENTS)}: 'cluster' is 'DPT' (the default, tensor-parallel "
        "ranks adjacent) and 'spread' is 'TPD'; in a letter string the right-most letter varies fastest "
        "(D = reduced data parallel, P = pipeline, T = tensor parallel)."
    )


@dataclass(frozen=True)
class Coords:
    """One rank's position on every axis (the values ``smp.pp_rank()`` etc. return on that rank)."""

    rank: int
    pp_rank: int
    tp_rank: int
    rdp_rank: int
    dp_rank: int
    mp_rank: int


def _check_degree(name: str, value: object) -> int:
    """Reject non-integer or non-positive degrees before any arithmetic hides the mistake."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise SMPConfigError(
            f"{name} must be a positive integer, got {value!r} ({type(value).__name__}). "
            f"Set {name} to 1 or more."
        )
    return int(value)


def _check_index(name: str, value: object, size: int) -> int:
    """Reject a rank or coordinate outside ``range(size)`` with the valid range in the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < size:
        raise SMPConfigError(
            f"{name} must be an integer in 0..{size - 1}, got {value!r}. "
            f"Pass a {name} that exists in this topology (its size on that axis is {size})."
        )
    return int(value)


@dataclass(frozen=True)
class Topology:
    """The job's layout: world size, pipeline and tensor degrees, and the 3-letter placement.

    Ranks are mixed-radix numbers over ``placement`` (right-most letter fastest); D, P and T digits are
    ``rdp_rank``, ``pp_rank`` and ``tp_rank``. Build it with :meth:`build`, which accepts the SMP aliases.
    """

    world_size: int
    pp_size: int
    tp_size: int
    placement: str

    def __post_init__(self) -> None:
        _check_degree("world size", self.world_size)
        _check_degree("pipeline_parallel_degree", self.pp_size)
        _check_degree("tensor_parallel_degree", self.tp_size)
        if self.placement not in _PERMUTATIONS:
            raise SMPConfigError(
                f"Topology.placement must be a permutation of 'DPT', got {self.placement!r}. "
                "Use Topology.build(..., placement_strategy=...) to pass 'cluster' or 'spread'."
            )
        mp = self.pp_size * self.tp_size
        if self.world_size % mp != 0:
            raise SMPConfigError(
                f"pipeline_parallel_degree ({self.pp_size}) x tensor_parallel_degree ({self.tp_size}) = {mp} "
                f"must divide the world size ({self.world_size}). Launch a multiple of {mp} processes, or "
                "choose degrees whose product divides the number of processes."
            )

    @classmethod
    def build(
        cls, world_size: int, pp_size: int = 1, tp_size: int = 1, placement_strategy: str = "cluster"
    ) -> Topology:
        """Validate SMP-style inputs (aliases allowed) and return the layout."""
        return cls(world_size, pp_size, tp_size, placement_letters(placement_strategy))

    # ---------------------------------------------------------------- sizes

    @property
    def rdp_size(self) -> int:
        """Replicas holding identical (pp, tp) shards: world / (pp * tp)."""
        return self.world_size // (self.pp_size * self.tp_size)

    @property
    def dp_size(self) -> int:
        """Size of the DP group (same pp_rank, all tp and rdp): world / pp."""
        return self.world_size // self.pp_size

    @property
    def mp_size(self) -> int:
        """Ranks that together hold one model replica: pp * tp."""
        return self.pp_size * self.tp_size

    # ---------------------------------------------------------------- digits

    def _radix(self, letter: str) -> int:
        """Size of the axis a placement letter stands for."""
        return {"D": self.rdp_size, "P": self.pp_size, "T": self.tp_size}[letter]

    def _left_of(self, first: str, second: str) -> bool:
        """Whether ``first`` sits left of ``second`` in the placement (so it varies more slowly)."""
        return self.placement.index(first) < self.placement.index(second)

    def _dp_of(self, tp_rank: int, rdp_rank: int) -> int:
        """dp_rank joins tp and rdp; the digit placed further right varies faster (§3)."""
        if self._left_of("T", "D"):
            return rdp_rank + self.rdp_size * tp_rank
        return tp_rank + self.tp_size * rdp_rank

    def _split_dp(self, dp_rank: int) -> tuple[int, int]:
        """Inverse of :meth:`_dp_of`: (tp_rank, rdp_rank)."""
        if self._left_of("T", "D"):
            return dp_rank // self.rdp_size, dp_rank % self.rdp_size
        return dp_rank % self.tp_size, dp_rank // self.tp_size

    def _mp_of(self, pp_rank: int, tp_rank: int) -> int:
        """mp_rank joins pp and tp; the digit placed further right varies faster (§3)."""
        if self._left_of("T", "P"):
            return pp_rank + self.pp_size * tp_rank
        return tp_rank + self.tp_size * pp_rank

    def _split_mp(self, mp_rank: int) -> tuple[int, int]:
        """Inverse of :meth:`_mp_of`: (pp_rank, tp_rank)."""
        if self._left_of("T", "P"):
            return mp_rank % self.pp_size, mp_rank // self.pp_size
        return mp_rank // self.tp_size, mp_rank % self.tp_size

    def _compose(self, pp_rank: int, tp_rank: int, rdp_rank: int) -> int:
        """Mixed-radix rank from already validated digits."""
        digit = {"D": rdp_rank, "P": pp_rank, "T": tp_rank}
        rank = 0
        for letter in self.placement:
            rank = rank * self._radix(letter) + digit[letter]
        return rank

    # ---------------------------------------------------------------- public lookups

    def coords(self, rank: int) -> Coords:
        """Every coordinate of global ``rank``."""
        rest = _check_index("rank", rank, self.world_size)
        digit: dict[str, int] = {}
        for letter in reversed(self.placement):
            rest, digit[letter] = divmod(rest, self._radix(letter))
        pp, tp, rdp = digit["P"], digit["T"], digit["D"]
        return Coords(int(rank), pp, tp, rdp, self._dp_of(tp, rdp), self._mp_of(pp, tp))

    def rank_of(self, pp_rank: int, tp_rank: int, rdp_rank: int) -> int:
        """Global rank at the given (pp, tp, rdp) coordinates."""
        pp = _check_index("pp_rank", pp_rank, self.pp_size)
        tp = _check_index("tp_rank", tp_rank, self.tp_size)
        rdp = _check_index("rdp_rank", rdp_rank, self.rdp_size)
        return self._compose(pp, tp, rdp)

    def group_rank(self, axis: str, rank: int) -> int:
        """``rank``'s index inside its group on ``axis`` (world: the rank itself)."""
        c = self.coords(rank)
        return {
            "pp": c.pp_rank,
            "tp": c.tp_rank,
            "rdp": c.rdp_rank,
            "dp": c.dp_rank,
            "mp": c.mp_rank,
            "world": c.rank,
        }[_check_axis(axis)]

    def group(self, axis: str, rank: int) -> list[int]:
        """Global ranks of ``rank``'s group on ``axis``; entry i has group rank i."""
        axis = _check_axis(axis)
        c = self.coords(rank)
        if axis == "world":
            return list(range(self.world_size))
        if axis == "pp":
            return [self._compose(p, c.tp_rank, c.rdp_rank) for p in range(self.pp_size)]
        if axis == "tp":
            return [self._compose(c.pp_rank, t, c.rdp_rank) for t in range(self.tp_size)]
        if axis == "rdp":
            return [self._compose(c.pp_rank, c.tp_rank, d) for d in range(self.rdp_size)]
        if axis == "dp":
            return [self._compose(c.pp_rank, *self._split_dp(i)) for i in range(self.dp_size)]
        return [self._compose(*self._split_mp(i), c.rdp_rank) for i in range(self.mp_size)]

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every distinct group on ``axis``, ordered by smallest member: the order all ranks create them in."""
        axis = _check_axis(axis)
        seen: set[int] = set()
        groups: list[list[int]] = []
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.group(axis, rank)
                seen.update(members)
                groups.append(members)
        return groups

    def table(self) -> list[Coords]:
        """One row per global rank, for printing the layout (``smp-compat run --dry-run``)."""
        return [self.coords(rank) for rank in range(self.world_size)]

    # ---------------------------------------------------------------- SMP's get_*_group helpers

    def get_pp_group(self, rank: int, dp_rank: int | None = None) -> list[int]:
        """The pipeline group whose members have ``dp_rank`` (default: ``rank``'s own)."""
        c = self.coords(rank)
        dp = c.dp_rank if dp_rank is None else _check_index("dp_rank", dp_rank, self.dp_size)
        tp, rdp = self._split_dp(dp)
        return [self._compose(p, tp, rdp) for p in range(self.pp_size)]

    def get_dp_group(self, rank: int, pp_rank: int | None = None) -> list[int]:
        """The DP group at pipeline stage ``pp_rank`` (default: ``rank``'s own)."""
        c = self.coords(rank)
        pp = c.pp_rank if pp_rank is None else _check_index("pp_rank", pp_rank, self.pp_size)
        return [self._compose(pp, *self._split_dp(i)) for i in range(self.dp_size)]

    def get_mp_group(self, rank: int, rdp_rank: int | None = None) -> list[int]:
        """The model replica (MP group) with ``rdp_rank`` (default: ``rank``'s own)."""
        c = self.coords(rank)
        rdp = c.rdp_rank if rdp_rank is None else _check_index("rdp_rank", rdp_rank, self.rdp_size)
        return [self._compose(*self._split_mp(i), rdp) for i in range(self.mp_size)]

    def get_tp_group(self, rank: int, pp_rank: int | None = None, rdp_rank: int | None = None) -> list[int]:
        """The TP group at (``pp_rank``, ``rdp_rank``), each defaulting to ``rank``'s own."""
        c = self.coords(rank)
        pp = c.pp_rank if pp_rank is None else _check_index("pp_rank", pp_rank, self.pp_size)
        rdp = c.rdp_rank if rdp_rank is None else _check_index("rdp_rank", rdp_rank, self.rdp_size)
        return [self._compose(pp, t, rdp) for t in range(self.tp_size)]

    def get_rdp_group(self, rank: int, pp_rank: int | None = None, tp_rank: int | None = None) -> list[int]:
        """The RDP group at (``pp_rank``, ``tp_rank``), each defaulting to ``rank``'s own."""
        c = self.coords(rank)
        pp = c.pp_rank if pp_rank is None else _check_index("pp_rank", pp_rank, self.pp_size)
        tp = c.tp_rank if tp_rank is None else _check_index("tp_rank", tp_rank, self.tp_size)
        return [self._compose(pp, tp, d) for d in range(self.rdp_size)]


def _check_axis(axis: str) -> str:
    """Reject an unknown axis name with the valid ones listed."""
    if axis not in AXES:
        raise SMPConfigError(f"Unknown group axis {axis!r}. Use one of {', '.join(repr(a) for a in AXES)}.")
    return axis
