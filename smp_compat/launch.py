"""Launch detection: which launcher started this process (torchrun, MPI, Slurm, none) and where rank 0 is."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from typing import Any, NamedTuple

from smp_compat.errors import SMPConfigError

__all__ = [
    "DEFAULT_PORT",
    "LAUNCHERS",
    "LaunchEnv",
    "SHARE_STORE_ENV",
    "STATIC_RENDEZVOUS_ENV",
    "attempt_prefix",
    "attempt_store",
    "detect_launch",
    "expand_slurm_nodelist",
]

DEFAULT_PORT = 29760
"""SMP's rendezvous port when neither ``ddp_port`` nor ``MASTER_PORT`` is given."""

LAUNCHERS: tuple[str, ...] = ("torchrun", "mpi", "slurm", "none")
"""Launchers recognised, in detection order."""

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch elastic's switch: ``1`` gives every c10d rendezvous round a fresh store for the workers
(``smp-compat run`` and ``smp-compat env`` set it; docs/design.md, "Restarts")."""

STATIC_RENDEZVOUS_ENV = "SMP_COMPAT_STATIC_RENDEZVOUS"
"""``1`` when ``smp-compat run`` started torchrun with its static rendezvous, which the workers cannot see:
there every node's restart count is the same, whatever ``SHARE_STORE_ENV`` says."""

_LOOPBACK = "127.0.0.1"
_INT = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job and the rendezvous address, as plain values read once."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int


class _Ranks(NamedTuple):
    """Rank numbers plus the variable each came from, so errors can name it."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    names: tuple[str, str, str, str]


# ---------------------------------------------------------------- reading variables


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value of ``name``; empty counts as unset (``export X=`` is a common way to clear)."""
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _parse_int(name: str, value: str, minimum: int) -> int:
    """Parse an integer environment value, naming the variable when it is malformed."""
    number = int(value) if _INT.fullmatch(value) else None
    if number is None or number < minimum:
        raise SMPConfigError(
            f"Environment variable {name}={value!r} is not an integer >= {minimum}. Your launcher or job "
            f"script set it to something else: fix or unset {name} and launch again."
        )
    return number


def _require_int(env: Mapping[str, str], name: str, minimum: int, launcher: str) -> int:
    """An integer the launcher always sets; missing means a partial or hand-made environment."""
    value = _get(env, name)
    if value is None:
        raise SMPConfigError(
            f"Environment variable {name} is not set, but other {launcher} variables are, so this looks like "
            f"a {launcher} launch. Launch with the real {launcher} launcher, or set {name} yourself."
        )
    return _parse_int(name, value, minimum)


def _optional_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    """An integer that may be absent."""
    value = _get(env, name)
    return None if value is None else _parse_int(name, value, minimum)


def _check_ranks(ranks: _Ranks, launcher: str) -> _Ranks:
    """Reject rank numbers that contradict each other, naming the variables involved."""
    rank_var, world_var, local_rank_var, local_size_var = ranks.names
    problems = []
    if ranks.rank >= ranks.world_size:
        problems.append(f"{rank_var}={ranks.rank} is not below {world_var}={ranks.world_size}")
    if ranks.local_rank >= ranks.local_size:
        problems.append(f"{local_rank_var}={ranks.local_rank} is not below {local_size_var}={ranks.local_size}")
    if ranks.local_size > ranks.world_size:
        problems.append(f"{local_size_var}={ranks.local_size} exceeds {world_var}={ranks.world_size}")
    if problems:
        raise SMPConfigError(
            f"The {launcher} environment is inconsistent: {'; '.join(problems)}. These variables are normally "
            "set by the launcher; unset any you exported by hand, or correct them."
        )
    return ranks


# ---------------------------------------------------------------- per launcher


def _torchrun_ranks(env: Mapping[str, str]) -> _Ranks:
    """torchrun / torch elastic; a hand-made RANK+WORLD_SIZE without locals is taken as one node."""
    for present, missing in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if _get(env, missing) is None:
            raise SMPConfigError(
                f"Environment variable {present} is set but {missing} is not. torchrun sets both; if you "
                f"launch by hand, export {missing} too, or unset {present} to run as a single process."
            )
    rank = _require_int(env, "RANK", 0, "torchrun")
    world = _require_int(env, "WORLD_SIZE", 1, "torchrun")
    local_size = _optional_int(env, "LOCAL_WORLD_SIZE", 1)
    local_rank = _optional_int(env, "LOCAL_RANK", 0)
    if local_rank is None:
        local_rank = rank if local_size is None else rank % local_size
    if local_size is None:
        local_size = world
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return _check_ranks(_Ranks(rank, world, local_rank, local_size, names), "torchrun")


def _mpi_ranks(env: Mapping[str, str]) -> _Ranks:
    """Open MPI's per-process variables (mpirun sets all four)."""
    names = (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    )
    values = [_require_int(env, name, minimum, "Open MPI") for name, minimum in zip(names, (0, 1, 0, 1))]
    return _check_ranks(_Ranks(*values, names), "Open MPI")


def _is_slurm_step(env: Mapping[str, str]) -> bool:
    """Only ``srun`` tasks count: a bare batch script also has SLURM_PROCID=0 but is one process."""
    has_step = _get(env, "SLURM_STEP_ID") is not None or _get(env, "SLURM_STEPID") is not None
    return _get(env, "SLURM_PROCID") is not None and has_step


def _slurm_ranks(env: Mapping[str, str]) -> _Ranks:
    """srun task variables; the step's task count wins over the job's."""
    rank = _require_int(env, "SLURM_PROCID", 0, "Slurm")
    world_var = "SLURM_STEP_NUM_TASKS" if _get(env, "SLURM_STEP_NUM_TASKS") is not None else "SLURM_NTASKS"
    if _get(env, world_var) is None:
        raise SMPConfigError(
            "Neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is set under srun, so the number of tasks is "
            "unknown. Launch with `srun --ntasks=N ...` (or export SLURM_NTASKS=N)."
        )
    world = _require_int(env, world_var, 1, "Slurm")
    local_rank = _require_int(env, "SLURM_LOCALID", 0, "Slurm")
    local_size, local_size_var = _slurm_local_size(env)
    names = ("SLURM_PROCID", world_var, "SLURM_LOCALID", local_size_var)
    return _check_ranks(_Ranks(rank, world, local_rank, local_size, names), "Slurm")


_TASKS_PER_NODE_SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("SLURM_STEP_TASKS_PER_NODE", ("SLURM_STEP_NODELIST",)),
    ("SLURM_TASKS_PER_NODE", ("SLURM_JOB_NODELIST", "SLURM_NODELIST")),
)
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def _parse_tasks_per_node(name: str, value: str) -> list[int]:
    """Slurm's compressed per-node task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_ITEM.fullmatch(item.strip())
        if match is None:
            raise SMPConfigError(
                f"Environment variable {name}={value!r} is not a Slurm task-count list such as '4' or "
                f"'2(x3),1'. Fix or unset {name} (srun sets it)."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _slurm_node_index(env: Mapping[str, str], nodelist_vars: tuple[str, ...]) -> int | None:
    """This node's position in the node list the task counts refer to, if it can be known."""
    node_name = _get(env, "SLURMD_NODENAME")
    for var in nodelist_vars:
        nodelist = _get(env, var)
        if node_name is not None and nodelist is not None:
            hosts = _expand_env_nodelist(var, nodelist)
            if node_name in hosts:
                return hosts.index(node_name)
    return _optional_int(env, "SLURM_NODEID", 0)


def _slurm_local_size(env: Mapping[str, str]) -> tuple[int, str]:
    """Tasks on this node: from the per-node list, else SLURM_NTASKS_PER_NODE."""
    for tasks_var, nodelist_vars in _TASKS_PER_NODE_SOURCES:
        value = _get(env, tasks_var)
        if value is None:
            continue
        counts = _parse_tasks_per_node(tasks_var, value)
        if len(set(counts)) == 1:
            return counts[0], tasks_var
        index = _slurm_node_index(env, nodelist_vars)
        if index is not None and index < len(counts):
            return counts[index], tasks_var
        break
    per_node = _optional_int(env, "SLURM_NTASKS_PER_NODE", 1)
    if per_node is not None:
        return per_node, "SLURM_NTASKS_PER_NODE"
    raise SMPConfigError(
        "Cannot tell how many Slurm tasks run on this node: SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE "
        "are missing or uneven without a way to find this node in them, and SLURM_NTASKS_PER_NODE is not set. "
        "Launch with `srun --ntasks-per-node=N ...`."
    )


# ---------------------------------------------------------------- rendezvous address and port


def _single_node_or_fail(ranks: _Ranks, launcher: str, hint: str) -> str:
    """Loopback when every rank is on this node; otherwise rank 0's host cannot be known here."""
    if ranks.local_size == ranks.world_size:
        return _LOOPBACK
    raise SMPConfigError(
        f"Cannot find rank 0's host for the {launcher} launch: the job spans several nodes "
        f"({ranks.world_size} processes, {ranks.local_size} on this one) and MASTER_ADDR is not set. "
        f"Export MASTER_ADDR=<hostname or IP of the node running rank 0> for every process{hint}."
    )


def _first_sm_host(value: str) -> str:
    """The first host of SageMaker's ``SM_HOSTS`` JSON list."""
    try:
        hosts = json.loads(value)
    except json.JSONDecodeError:
        hosts = None
    if not isinstance(hosts, list) or not hosts or not isinstance(hosts[0], str) or not hosts[0]:
        raise SMPConfigError(
            f"Environment variable SM_HOSTS={value!r} is not a non-empty JSON list of host names such as "
            '\'["algo-1", "algo-2"]\'. Fix or unset SM_HOSTS, or set MASTER_ADDR.'
        )
    return hosts[0]


def _master_addr(env: Mapping[str, str], launcher: str, ranks: _Ranks) -> str:
    """MASTER_ADDR wins; otherwise what each launcher can tell about rank 0's host."""
    addr = _get(env, "MASTER_ADDR")
    if addr is not None:
        return addr
    if launcher == "none":
        return _LOOPBACK
    if launcher == "mpi":
        sm_hosts = _get(env, "SM_HOSTS")
        if sm_hosts is not None and _get(env, "SMP_COMPAT_LOCAL_HOSTS") is None:  # not names smp-compat made up
            return _first_sm_host(sm_hosts)
        return _single_node_or_fail(ranks, "Open MPI", " (e.g. `mpirun -x MASTER_ADDR=...`)")
    if launcher == "slurm":
        for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            nodelist = _get(env, var)
            if nodelist is not None:
                hosts = _expand_env_nodelist(var, nodelist)
                if hosts:
                    return hosts[0]
        return _single_node_or_fail(ranks, "Slurm", "")
    return _single_node_or_fail(ranks, launcher, " (torchrun sets it)")


def _check_port(name: str, port: object) -> int:
    """A TCP port other ranks can connect to."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SMPConfigError(
            f"{name} must be a TCP port number in 1..65535, got {port!r}. Choose a free port that every "
            "node can reach."
        )
    return port


def _master_port(env: Mapping[str, str], ddp_port: int | None) -> int:
    """``ddp_port`` (config) over MASTER_PORT over SMP's default, as SMP's rendezvous does."""
    if ddp_port is not None:
        return _check_port("ddp_port", ddp_port)
    value = _get(env, "MASTER_PORT")
    if value is None:
        return DEFAULT_PORT
    return _check_port("Environment variable MASTER_PORT", _parse_int("MASTER_PORT", value, 1))


# ---------------------------------------------------------------- public entry points


def _detect_ranks(env: Mapping[str, str]) -> tuple[str, _Ranks]:
    """Pick the launcher by ARCHITECTURE.md's order and read its rank variables."""
    if _get(env, "RANK") is not None or _get(env, "WORLD_SIZE") is not None:
        return "torchrun", _torchrun_ranks(env)
    if _get(env, "OMPI_COMM_WORLD_RANK") is not None:
        return "mpi", _mpi_ranks(env)
    if _is_slurm_step(env):
        return "slurm", _slurm_ranks(env)
    return "none", _Ranks(0, 1, 0, 1, ("rank", "world size", "local rank", "local size"))


def detect_launch(environ: Mapping[str, str] | None = None, ddp_port: int | None = None) -> LaunchEnv:
    """Read the launcher's variables once, so the rest of smp_compat works from plain values.

    Order: torchrun (``RANK``/``WORLD_SIZE``), Open MPI (``OMPI_COMM_WORLD_*``), Slurm under ``srun``
    (``SLURM_PROCID`` plus a step id), else a world of one. ``environ`` defaults to ``os.environ``.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    port = _master_port(env, ddp_port)
    launcher, ranks = _detect_ranks(env)
    return LaunchEnv(
        launcher=launcher,
        rank=ranks.rank,
        world_size=ranks.world_size,
        local_rank=ranks.local_rank,
        local_size=ranks.local_size,
        master_addr=_master_addr(env, launcher, ranks),
        master_port=port,
    )


_BRACKET = re.compile(r"(\[[^\[\]]*\])")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _nodelist_error(nodelist: object, why: str) -> SMPConfigError:
    return SMPConfigError(
        f"Slurm node list {nodelist!r} is malformed: {why}. Expected Slurm's hostlist form, such as "
        "'node[01-03,07],gpu5'; check the variable it came from (SLURM_*NODELIST) or MASTER_ADDR."
    )


def _split_top_level(nodelist: str) -> list[str]:
    """Split on commas outside brackets; brackets must be balanced and not nested."""
    items: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(nodelist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise _nodelist_error(nodelist, "nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _nodelist_error(nodelist, "']' without '['")
        elif char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise _nodelist_error(nodelist, "'[' without ']'")
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(nodelist: str, inner: str) -> list[str]:
    """``"01-03,7"`` -> ``["01", "02", "03", "7"]``; zero padding follows the range's start."""
    values: list[str] = []
    for part in inner.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise _nodelist_error(nodelist, f"{part.strip()!r} inside brackets is not a number or range")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise _nodelist_error(nodelist, f"range {part.strip()!r} runs backwards")
        values.extend(str(n).zfill(len(low_text)) for n in range(low, high + 1))
    return values


def _expand_item(nodelist: str, item: str) -> list[str]:
    """One comma-free entry, possibly with several bracket groups (their product, left to right)."""
    parts = [
        _expand_ranges(nodelist, piece[1:-1]) if piece.startswith("[") else [piece]
        for piece in _BRACKET.split(item)
    ]
    return ["".join(combo) for combo in product(*parts)]


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: ``"node[01-03,07],gpu5"`` -> node01, node02, node03, node07, gpu5."""
    if not isinstance(nodelist, str):
        raise _nodelist_error(nodelist, f"expected a string, got {type(nodelist).__name__}")
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(nodelist, item))
    return hosts


def _expand_env_nodelist(var: str, nodelist: str) -> list[str]:
    """Expand a node list read from ``var``, naming the variable if it is malformed."""
    try:
        return expand_slurm_nodelist(nodelist)
    except SMPConfigError as error:
        raise SMPConfigError(f"Environment variable {var}: {error}") from None


def attempt_prefix(env: Mapping[str, str]) -> str | None:
    """The store prefix a restarted torchrun attempt's process group needs, or None when it needs none.

    Under a static rendezvous (torchrun's default) the workers' store is the agent's, kept across restarts
    with every key the failed attempt wrote, so a restarted rank can read a dead rank's address
    (pytorch/pytorch#135712). Keys under a prefix naming the attempt cannot collide. The restart count is
    the same on every node only when restarts follow failures alone: one agent, or a static rendezvous
    (the agent store with ``SHARE_STORE_ENV=1``, which gives c10d rendezvous a fresh store instead, or
    ``smp-compat run``'s word for it, ``STATIC_RENDEZVOUS_ENV``, when the user set the variable to 0).
    """
    count = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not count.isdigit() or int(count) == 0:
        return None
    static = env.get(SHARE_STORE_ENV) == "1" or env.get(STATIC_RENDEZVOUS_ENV) == "1"
    if env.get("GROUP_WORLD_SIZE") == "1" or static:
        return f"smp_compat/attempt{int(count)}/"
    return None


def attempt_store(prefix: str, master_addr: str, master_port: int, world_size: int, timeout: Any) -> Any:
    """A client of torchrun's agent store whose keys live under ``prefix`` (``attempt_prefix``): how a
    restarted attempt's process group rendezvouses, for ``smp.init`` and for an SMP v2 script's own call."""
    import torch.distributed as dist  # here, not at the top: the rest of this module needs no torch

    store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, store)
