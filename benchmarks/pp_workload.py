"""The pp = 2 workload the pipeline benchmarks share: an MLP split in half, under smp_compat and under torch.

Both libraries get the same model (same seed), the same split (first half of the Linear layers on pipeline
rank 0, second half on rank 1), the same batches, the same optimizer and a mean-squared-error loss. For
smp_compat the loss is computed in the ``@smp.step`` body on rank 0, as SMP scripts do; for torch it is
the schedule's ``loss_fn`` on the last stage, as torch requires. Every function here runs inside one rank
of a 2-rank gloo job (``smp_compat.testing.run_ranks``), which lets both libraries share one world.
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import smp_compat as smp  # noqa: E402 - after the path tweak, with the other benchmark imports
from pp1_overhead import make_mlp  # noqa: E402

__all__ = [
    "SMP_VARIANTS",
    "TORCH_VARIANTS",
    "SmpRunner",
    "TorchRunner",
    "bind_to_core",
    "make_batches",
    "make_mlp",
    "preload",
    "split_index",
    "smp_config",
]

# name -> (smp "pipeline", active_microbatches or None for smp's default min(pp + 2, microbatches))
SMP_VARIANTS: dict[str, tuple[str, int | None]] = {
    "smp-interleaved": ("interleaved", None),
    "smp-interleaved-a8": ("interleaved", 8),
    "smp-simple": ("simple", None),
}
TORCH_VARIANTS = ("torch-1F1B", "torch-GPipe")


def preload() -> None:
    """Import in the parent what every rank would otherwise import after the fork, each on its own.

    The first optimizer imports torch._dynamo (seconds), and torch's pipelining package is large; forked
    ranks inherit what the parent already has.
    """
    import torch.distributed.pipelining  # noqa: F401

    _sgd([torch.zeros(1, requires_grad=True)])


def bind_to_core(rank: int) -> None:
    """Keep every thread of this rank (those running and those it starts later) on one core of its own.

    Both libraries get the same binding (they share the rank's process). Unbound, the OS moves threads
    between the two cores of this machine, and a thread woken on the core where the other rank computes
    shares that core until the next load balance: that cost lands mostly on a runtime that hands work
    between threads, which smp_compat's tasks do and torch's single-threaded schedules do not.
    """
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[rank % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:  # a thread that ended meanwhile
            pass


def split_index(layers: int) -> int:
    """Index in ``make_mlp``'s Sequential of the first module on rank 1: Linear number ``layers // 2``."""
    return 2 * (layers // 2)


def smp_config(microbatches: int, pipeline: str = "interleaved", active: int | None = None) -> dict[str, Any]:
    """pp = 2, manual partition: everything on rank 0 unless ``smp.set_partition`` says otherwise."""
    cfg: dict[str, Any] = {
        "pipeline_parallel_degree": 2, "microbatches": microbatches, "pipeline": pipeline,
        "auto_partition": False, "default_partition": 0,
    }  # fmt: skip
    if active is not None:
        cfg["active_microbatches"] = active
    return cfg


def make_batches(width: int, batch: int, count: int = 2, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed random inputs and targets, identical on every rank and for both libraries."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(count)]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


@dataclass
class SmpRunner:
    """The one DistributedModel of this process (SMP allows one), with a way to switch its schedule."""

    model: Any
    optimizer: Any
    step_fn: Any
    losses: list[float]

    @classmethod
    def create(cls, width: int, layers: int, microbatches: int, module: nn.Module | None = None) -> SmpRunner:
        """``smp.init`` + model + optimizer; the second half of the Linear layers goes to pipeline rank 1."""
        smp.init(smp_config(microbatches))
        net = module if module is not None else make_mlp(width, layers)
        model = smp.DistributedModel(net)
        first_remote = split_index(layers)
        for index, child in enumerate(model.module):
            if index >= first_remote and any(True for _ in child.parameters(recurse=False)):
                smp.set_partition(child, 1)
        optimizer = smp.DistributedOptimizer(_sgd(model.parameters()))

        @smp.step
        def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        return cls(model, optimizer, train_step, [])

    def use(self, variant: str) -> None:
        """Switch between "interleaved" and "simple" and the in-flight limit, between steps.

        SMP fixes the schedule at ``smp.init`` and allows one model per process; a benchmark that alternates
        schedules inside one job therefore swaps the engine's (immutable) config object. The engine reads
        ``pipeline`` and ``active_microbatches`` afresh at the start of every step, so this is exact.
        """
        pipeline, active = SMP_VARIANTS[variant]
        engine = self.model.pipeline_engine
        if engine is None:
            raise RuntimeError("run one step before switching schedules: the engine exists after partitioning")
        if active is None:
            cfg = smp.state.cfg
            simple = pipeline == "simple"
            active = cfg.microbatches if simple else min(cfg.pipeline_parallel_degree + 2, cfg.microbatches)
        engine.cfg = smp.state.cfg.model_copy(update={"pipeline": pipeline, "active_microbatches": active})

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training step as an SMP script writes it (rank 1's inputs are ignored, as in SMP)."""
        self.optimizer.zero_grad()
        out = self.step_fn(self.model, x, y)
        self.losses = [float(v) for v in out] if smp.pp_rank() == 0 else []
        self.optimizer.step()

    @property
    def bytes_sent(self) -> int:
        return int(self.model.pipeline_engine.bytes_sent)


@dataclass
class TorchRunner:
    """One ``PipelineStage`` (this rank's half of the MLP) driven by one torch schedule."""

    stage_module: nn.Module
    schedule: Any
    optimizer: torch.optim.Optimizer
    is_last: bool
    losses: list[float]

    @classmethod
    def create(cls, variant: str, width: int, layers: int, batch: int, microbatches: int) -> TorchRunner:
        """Stage ``rank`` of 2 over the default (gloo) group, which smp_compat's world shares."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        rank = dist.get_rank()
        full = make_mlp(width, layers)
        cut = split_index(layers)
        stage_module = copy.deepcopy(full[:cut] if rank == 0 else full[cut:])
        # Static shapes: no metadata exchange by pickled objects (which needs numpy) and no extra first step.
        # requires_grad marks which activations have gradients to send back (rank 1's input, both outputs).
        inputs = torch.empty(batch // microbatches, width, requires_grad=rank == 1)
        outputs = torch.empty(batch // microbatches, width, requires_grad=True)
        stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"), input_args=inputs, output_args=outputs)
        schedule_cls = {"torch-1F1B": Schedule1F1B, "torch-GPipe": ScheduleGPipe}[variant]
        schedule = schedule_cls(stage, n_microbatches=microbatches, loss_fn=F.mse_loss)
        return cls(stage_module, schedule, _sgd(stage_module.parameters()), rank == 1, [])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The first stage feeds inputs, the last gets the target and computes the per-microbatch losses."""
        self.optimizer.zero_grad()
        if self.is_last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=y, losses=losses)
            self.losses = [float(v.detach()) for v in losses]
        else:
            self.schedule.step(x)
        self.optimizer.step()
