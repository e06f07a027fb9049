"""The environment report: versions, hosts, devices per rank, and the backend and pipeline links chosen, and why.

Collected once, right after an ``smp.init`` made the job's process group the way the user's job would
(same launcher, ``ddp_dist_backend`` and device rule), and gathered from every rank; the checks' skips are
decided from it, identically on every rank.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from smp_compat.checkpoints.signing import describe_key

__all__ = ["Environment", "RankInfo", "collect"]

_SHIM_MODULE = "smdistributed.modelparallel.torch"


@dataclass(frozen=True)
class RankInfo:
    """One rank as it sees itself."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    device: str
    device_name: str
    gpus: int
    nccl_env: dict[str, str]
    versions: dict[str, str | None]
    bf16: bool
    checkpoint_key: str


@dataclass(frozen=True)
class Environment:
    """The whole job, the same on every rank (built from every rank's ``RankInfo``): every skip is decided from
    it, so every rank skips the same checks (a rank that ran a check alone would wait for the others forever)."""

    versions: dict[str, str | None]
    world_size: int
    backend: str
    backend_reason: str
    pipeline_links: str
    shim: str
    ranks: list[RankInfo]
    bf16_on_device: bool
    notes: list[str] = field(default_factory=list)

    @property
    def hosts(self) -> dict[str, list[int]]:
        """Ranks per host, in rank order."""
        out: dict[str, list[int]] = {}
        for info in self.ranks:
            out.setdefault(info.host, []).append(info.rank)
        return out

    @property
    def device_type(self) -> str:
        return self.ranks[0].device.split(":")[0]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["hosts"] = self.hosts
        return data


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> dict[str, str | None]:
    import smp_compat

    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "python": ".".join(str(v) for v in sys.version_info[:3]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "transformers": _version("transformers"),
        "smp_compat": smp_compat.__version__,
    }


def _this_rank(smp: Any) -> RankInfo:
    device = smp.state.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    bf16 = device.type == "cpu" or torch.cuda.is_bf16_supported()
    return RankInfo(smp.rank(), socket.gethostname(), smp.local_rank(), smp.local_size(), str(device), name, gpus,
                    nccl_env, _versions(), bf16, describe_key())  # fmt: skip


def _backend_reason(smp: Any, ranks: list[RankInfo]) -> str:
    """Why the job's groups use this backend, by the rule of ``smp.init`` (globalstate._choose_backend)."""
    asked = smp.state.cfg.ddp_dist_backend
    if asked in ("nccl", "gloo"):
        return f'ddp_dist_backend is "{asked}"'
    gpus = min(i.gpus for i in ranks)
    local = max(i.local_size for i in ranks)
    if gpus == 0:
        return "no GPU: gloo, which moves host memory"
    if local > gpus:
        return f"{local} processes share {gpus} GPU(s) on a node: gloo (NCCL needs one GPU per process)"
    return f"one GPU per process ({local} process(es), {gpus} GPU(s) per node): NCCL"


def _pipeline_links(backend: str) -> str:
    """How pipeline stages exchange activations (runtime/transport.py, runtime/local_links.py)."""
    from smp_compat.runtime import local_links

    if backend == "nccl":
        return "NCCL point-to-point (exact-size messages in GPU memory)"
    if local_links.enabled():
        return "shared memory between ranks of one host, gloo between hosts"
    return f"gloo (shared memory off: {local_links.ENV}=0, or not Linux x86-64)"


def _shim() -> str:
    """Whether an unmodified SMP script's ``import smdistributed.modelparallel.torch`` reaches smp_compat here."""
    import importlib

    import smp_compat

    try:
        module = importlib.import_module(_SHIM_MODULE)
    except ImportError:
        return f"{_SHIM_MODULE} is not importable (launched without smp-compat run / smp-compat env)"
    if module is smp_compat:
        return f"{_SHIM_MODULE} -> smp_compat"
    return f"{_SHIM_MODULE} is another library ({getattr(module, '__file__', module)})"


def collect(smp: Any) -> Environment:
    """Every rank's facts, gathered (a collective over the world: call it on every rank)."""
    mine = _this_rank(smp)
    ranks: list[Any] = [None] * smp.size()
    if dist.is_initialized():
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    backend = smp.state.backend
    notes = []
    if len({tuple(sorted(i.nccl_env.items())) for i in ranks}) > 1:
        notes.append("ranks differ in their NCCL_* variables (see the JSON report)")
    if len({i.checkpoint_key.split(" (")[0] for i in ranks}) > 1:
        notes.append("ranks use different checkpoint keys (see the JSON report): each verifies only its own saves")
    if any(i.versions != ranks[0].versions for i in ranks):
        notes.append("ranks differ in package versions (see the JSON report): rank 0's are shown")
    return Environment(ranks[0].versions, smp.size(), backend, _backend_reason(smp, ranks), _pipeline_links(backend),
                       _shim(), ranks, all(i.bf16 for i in ranks), notes)  # fmt: skip
