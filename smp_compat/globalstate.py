"""The single process-wide state behind the module-level smp API, and ``smp.init``.

SMP's API is module-level (``smp.rank()``, ``smp.state.cfg``), so some global state is
unavoidable; it lives here, in one object, with one reset hook for tests.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from smp_compat import failure
from smp_compat.config import SMPConfig, resolve_config
from smp_compat.errors import SMPConfigError, SMPNotInitializedError
from smp_compat.host.heap import TRIM_BYTES, TUNE_MALLOC_ENV, keep_freed_memory
from smp_compat.launch import LaunchEnv, attempt_prefix, attempt_store, detect_launch
from smp_compat.module_manager import ModuleManager
from smp_compat.topology import Topology

if TYPE_CHECKING:
    from smp_compat.model import DistributedModel

__all__ = ["state", "init", "is_initialized", "reset", "shutdown", "AXES_WITH_GROUPS", "BIND_ENV", "bind_from_environment",
           "core_share", "release_process_group", "tune_from_environment"]

log = logging.getLogger("smp_compat")

AXES_WITH_GROUPS = ("pp", "tp", "rdp", "dp", "mp")
_PG_TIMEOUT_ENV = "SMP_PG_TIMEOUT_S"
_DEFAULT_PG_TIMEOUT_S = 600.0


@dataclass
class _State:
    """Everything ``smp.init`` resolves, plus the one model and optimizer of the process."""

    cfg: SMPConfig | None = None
    launch: LaunchEnv | None = None
    topology: Topology | None = None
    backend: str = "gloo"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict[str, Any] = field(default_factory=dict)
    owns_process_group: bool = False
    model: DistributedModel | None = None
    optimizer: Any = None
    initialized: bool = False
    module_manager: ModuleManager = field(default_factory=ModuleManager)  # SMP >= 1.10; transformers reads it

    def require_init(self, what: str) -> None:
        """Raise the error a user sees when calling ``what`` before ``smp.init()``."""
        if not self.initialized:
            raise SMPNotInitializedError(
                f"{what} needs smp.init() to have been called first. Call smp.init(config) at the top of "
                "your script, before creating the DistributedModel."
            )

    @property
    def rank(self) -> int:
        return self.launch.rank if self.launch else 0

    @property
    def world_size(self) -> int:
        return self.launch.world_size if self.launch else 1


state = _State()


def is_initialized() -> bool:
    """True once ``smp.init`` has run."""
    return state.initialized


def init(config: Mapping[str, Any] | str | os.PathLike[str] | None = None) -> None:
    """Read the config, find the launcher, set up process groups and the device (SMP's ``smp.init``)."""
    if state.initialized:
        warnings.warn("smp.init() was already called; this call is ignored.", stacklevel=2)
        return
    cfg = resolve_config(config)
    launch = _launch_env(cfg)
    cfg.check_world_size(launch.world_size)
    topology = Topology.build(
        launch.world_size, cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.placement_strategy
    )
    backend = _choose_backend(cfg, launch)
    state.cfg, state.launch, state.topology, state.backend = cfg, launch, topology, backend
    state.device = _choose_device(backend, launch.local_rank)
    _export_rank_variables(launch)
    bind_from_environment(launch.local_rank, launch.local_size)
    tune_from_environment(pipelined_on_cpu=topology.pp_size > 1 and state.device.type == "cpu")
    if launch.world_size > 1 or cfg.ddp:
        _init_process_groups(launch, topology, backend)
    state.initialized = True
    atexit.register(_at_exit)
    _warn_not_acted_on(cfg)
    if launch.rank == 0:
        log.info("smp_compat initialized: %s", cfg.to_dict())


def _launch_env(cfg: SMPConfig) -> LaunchEnv:
    """The launch environment, trusting an already-initialized process group (tests, user code) first."""
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return LaunchEnv("existing", rank, world, local_rank, local_size, "", 0)
    return detect_launch(ddp_port=cfg.ddp_port)


def _choose_backend(cfg: SMPConfig, launch: LaunchEnv) -> str:
    """NCCL when every local process has a GPU of its own, gloo otherwise (``ddp_dist_backend``).

    A process group the script already made decides. NCCL refuses two ranks on one GPU, so processes
    that share GPUs (more local ranks than GPUs) talk over gloo, which moves host memory.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = gpus > 0 and launch.local_size > gpus
    if cfg.ddp_dist_backend == "nccl":
        if not gpus:
            raise SMPConfigError(
                'ddp_dist_backend is "nccl" but CUDA is not available on this machine. Use "gloo" or "auto".'
            )
        if shared:
            raise SMPConfigError(
                f'ddp_dist_backend is "nccl" but {launch.local_size} processes on this node share {gpus} GPU(s); '
                'NCCL needs one GPU per process. Start one process per GPU, or use "gloo" or "auto".'
            )
        return "nccl"
    if cfg.ddp_dist_backend == "gloo" or not gpus:
        return "gloo"
    if shared:
        log.info("%d processes share %d GPU(s) on this node: using gloo (NCCL needs one GPU per process).",
                 launch.local_size, gpus)
        return "gloo"
    return "nccl"


def _choose_device(backend: str, local_rank: int) -> torch.device:
    """One GPU per local rank (as SMP set it); local ranks share GPUs round-robin when there are fewer GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _export_rank_variables(launch: LaunchEnv) -> None:
    """SMP sets these for the script; some scripts read them."""
    os.environ["RANK"] = str(launch.rank)
    os.environ["WORLD_SIZE"] = str(launch.world_size)
    os.environ["LOCAL_RANK"] = str(launch.local_rank)


def _pg_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get(_PG_TIMEOUT_ENV, _DEFAULT_PG_TIMEOUT_S)))


def _init_process_groups(launch: LaunchEnv, topology: Topology, backend: str) -> None:
    """Create the default group (unless one exists) and one group per axis, the same order on every rank."""
    if not dist.is_initialized() and launch.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        state.owns_process_group = True
    elif not dist.is_initialized() and launch.launcher == "torchrun" and (prefix := attempt_prefix(os.environ)):
        store = attempt_store(prefix, launch.master_addr, launch.master_port, launch.world_size, _pg_timeout())
        dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                timeout=_pg_timeout())  # fmt: skip
        state.owns_process_group = True
    elif not dist.is_initialized() and launch.launcher == "torchrun":
        # torchrun's agent already hosts the store (TORCHELASTIC_USE_AGENT_STORE): join it through env://
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size, timeout=_pg_timeout())
        state.owns_process_group = True
    elif not dist.is_initialized():
        store = dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            launch.world_size,
            is_master=launch.rank == 0,
            timeout=_pg_timeout(),
        )
        dist.init_process_group(
            backend, store=store, rank=launch.rank, world_size=launch.world_size, timeout=_pg_timeout()
        )
        state.owns_process_group = True
    state.groups = {"world": dist.group.WORLD}
    for axis in AXES_WITH_GROUPS:
        state.groups[axis] = _create_axis_groups(topology, axis, launch.rank)
    failure.start_watch(launch.rank)


def _create_axis_groups(topology: Topology, axis: str, rank: int) -> Any:
    """Every rank creates every group of the axis (torch requires it); return this rank's."""
    mine = None
    for members in topology.all_groups(axis):
        if len(members) == topology.world_size:
            group = dist.group.WORLD
        else:
            group = dist.new_group(members, timeout=_pg_timeout())
        if rank in members:
            mine = group
    return mine


def _warn_not_acted_on(cfg: SMPConfig) -> None:
    if cfg.offload_activations and state.device.type != "cuda":
        log.warning("offload_activations moves checkpointed activations to host memory on CUDA; on CPU it does nothing.")
    for key in cfg.inert_keys():
        log.debug("%s has no effect with this config (as in SMP): ignored.", key)
    keys = cfg.not_acted_on()
    if keys:
        warnings.warn(
            "smp_compat accepts these config keys but does not act on them yet: "
            + ", ".join(keys)
            + ". See docs/config.md.",
            stacklevel=3,
        )


def process_group(axis: str) -> Any:
    """This rank's torch.distributed group on ``axis`` (None in a world of one without ``ddp``)."""
    state.require_init(f"the {axis} process group")
    return state.groups.get(axis)


def reset() -> None:
    """Forget everything ``init`` set up (tests, and scripts that re-init)."""
    engine = getattr(state.model, "pipeline_engine", None)
    if engine is not None:
        engine.close()
    failure.stop_watch()
    atexit.unregister(_at_exit)
    if state.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    state.__init__()  # type: ignore[misc]


def release_process_group() -> None:
    """Let the next ``reset`` leave the default process group up; the caller destroys it.

    ``smp-compat selftest`` makes the group through ``smp.init`` (so it is the group the user's job would
    get: same launcher, backend and device), then re-initializes smp once per check in that one job.
    """
    state.owns_process_group = False


def shutdown() -> None:
    """Tear down process groups; SMP ran this at exit."""
    reset()


def _at_exit() -> None:
    """Interpreter exit without ``smp.shutdown``: tell the other ranks when this rank left early, then shut down."""
    failure.exiting()
    shutdown()


# ---------------------------------------------------------------- launcher switches: core binding, malloc tuning
# Core binding: each local rank pinned to its own share of the cores (``smp-compat run --bind-cores``).
# 
# Unbound, the OS moves a rank's threads between cores, and a thread it wakes may land on a core that
# another rank keeps busy; the two then share that core until the next load balance. On the 2-core
# development machine that made compute spans 10-40% longer (docs/benchmarks.md), and it costs an engine
# that hands work between threads (smp_compat's tasks) more than a single-threaded schedule. The launcher
# only sets a variable; each process binds itself in ``smp.init``, when its local rank is known.

BIND_ENV = "SMP_COMPAT_BIND_CORES"
"""Set to ``1`` (``smp-compat run --bind-cores`` does) to pin each local rank to its share of the cores."""



def core_share(cores: Sequence[int], local_rank: int, local_size: int) -> set[int]:
    """Local rank ``local_rank``'s contiguous slice of ``cores``; ranks share cores only when there are fewer.

    With 8 cores and 2 ranks: ``{0..3}`` and ``{4..7}``; with 10 cores and 4 ranks the first two ranks get
    3 cores, the others 2; with 2 cores and 4 ranks, ranks 0 and 2 share core 0.
    """
    ordered = sorted(cores)
    if not ordered or local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError(f"no core share for local rank {local_rank} of {local_size} on cores {ordered}")
    if len(ordered) < local_size:
        return {ordered[local_rank % len(ordered)]}
    base, extra = divmod(len(ordered), local_size)
    start = local_rank * base + min(local_rank, extra)
    return set(ordered[start : start + base + (1 if local_rank < extra else 0)])


def bind_process(cores: set[int]) -> None:
    """Pin every thread of this process (running ones included, e.g. torch's OpenMP pool) to ``cores``.

    Threads started later inherit the mask of the thread that starts them.
    """
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def bind_from_environment(local_rank: int, local_size: int, environ: Mapping[str, str] | None = None) -> set[int] | None:
    """Bind this process to its share of the cores it may use when ``SMP_COMPAT_BIND_CORES=1``; the cores, or None."""
    if not _switch(BIND_ENV, environ):
        return None
    if not hasattr(os, "sched_setaffinity"):
        log.warning("%s is set but this platform cannot bind threads to cores; running unbound", BIND_ENV)
        return None
    cores = core_share(sorted(os.sched_getaffinity(0)), local_rank, local_size)
    bind_process(cores)
    log.info("local rank %d bound to cores %s", local_rank, sorted(cores))
    return cores


def tune_from_environment(environ: Mapping[str, str] | None = None, *, pipelined_on_cpu: bool = False) -> bool:
    """Apply ``heap.keep_freed_memory`` by default in a CPU pipeline, or as ``SMP_COMPAT_TUNE_MALLOC`` says
    (``1``: ``smp-compat run --tune-malloc``, ``0``: ``--no-tune-malloc``); whether it was applied.

    A CPU pipeline rank runs its microbatches on several threads, and glibc trims each thread's heap apart,
    so without this every step faults its activations in again (docs/benchmarks.md, 2026-11-24 06:00).
    """
    asked = _switch(TUNE_MALLOC_ENV, environ)
    if not (pipelined_on_cpu if asked is None else asked):
        return False
    if not keep_freed_memory():
        if asked:
            log.warning("%s is set but malloc is not glibc's here (another C library, or LD_PRELOAD); left as it is",
                        TUNE_MALLOC_ENV)
        return False
    log.info("malloc keeps up to %d MiB of freed memory per heap (%s=0 to leave it alone)", TRIM_BYTES >> 20,
             TUNE_MALLOC_ENV)  # fmt: skip
    return True


def _switch(name: str, environ: Mapping[str, str] | None) -> bool | None:
    """A launcher switch in ``environ`` (the process environment by default): on, off, or None when unset."""
    env = os.environ if environ is None else environ
    value = env.get(name, "").strip().lower()
    return True if value in ("1", "true") else False if value in ("0", "false") else None
