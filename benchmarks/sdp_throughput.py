"""Step time of smp_compat's sharded data parallelism against plain FSDP2 ``fully_shard`` and DDP.

All three train the same model (``sdp_memory.Stack``) with AdamW and global-norm clipping at 1.0 on the
same ranks, in the same run, in alternating rounds (so machine drift hits all alike):

- ``smp``: ``smp.init({"sharded_data_parallel_degree": world})``, ``smp.DistributedModel``, an ``@smp.step``
  function and ``smp.DistributedOptimizer`` (clipping inside ``step()``, as SMP);
- ``fsdp2``: ``fully_shard`` on each block then the root over the same CPU/CUDA mesh, ``clip_grad_norm_``;
- ``ddp``: torch ``DistributedDataParallel`` (every rank holds the whole state).

``--precision bf16`` (SMP's AWS notebooks): ``smp`` builds the model under ``smp.model_creation(dtype=torch.bfloat16)``
with the ``bf16`` key (fp32 master shards, bf16 gathers and compute, fp32 gradient reduction); ``fsdp2``
shards an fp32 model with the same ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, so
both hold fp32 shards and fp32 AdamW state; DDP has no such policy and is left out.

Figure of merit: median over rounds of time(fsdp2) / time(smp), target >= 0.95 (printed; exit status 1 when
missed). Do not read timings taken on a loaded machine.

    python benchmarks/sdp_throughput.py [--world 2 --width 512 --layers 8 --batch 64 --rounds 5 --steps 5]  # CPU
    python benchmarks/sdp_throughput.py --precision bf16                                                  # CPU, bf16
    torchrun --nproc-per-node 2 benchmarks/sdp_throughput.py --width 4096 --layers 8   # GPUs, NCCL

Without a launcher it forks ``--world`` CPU ranks (gloo, CUDA hidden); under torchrun each rank uses its GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from sdp_memory import Stack
from smp_compat.testing import run_ranks

__all__ = ["main", "run_variants", "VARIANTS", "BF16_VARIANTS", "plain_fsdp2", "variants"]

VARIANTS = ("smp", "fsdp2", "ddp")
BF16_VARIANTS = ("smp", "fsdp2")


def variants(precision: str) -> tuple[str, ...]:
    return VARIANTS if precision == "fp32" else BF16_VARIANTS


def _smp_variant(width: int, layers: int, x: torch.Tensor, precision: str) -> Callable[[], float]:
    import smp_compat as smp

    torch.manual_seed(0)
    with smp.model_creation(dtype=torch.bfloat16 if precision == "bf16" else None):
        module = Stack(width, layers)
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    def step() -> float:
        opt.zero_grad()
        out = train_step(model, x)
        opt.step()
        return float(out.reduce_mean())

    return step


def fsdp2_policy(precision: str) -> Any:
    """Plain FSDP2's policy: bf16 gathers and compute with fp32 gradient reduction, as smp_compat's under bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def plain_fsdp2(module: torch.nn.Module, precision: str, device_type: str) -> Any:
    """``fully_shard`` on each block then the root (smp_compat's units), fp32 shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for block in module.blocks:
        fully_shard(block, mesh=mesh, mp_policy=fsdp2_policy(precision))
    return fully_shard(module, mesh=mesh, mp_policy=fsdp2_policy(precision))


def _torch_variant(kind: str, width: int, layers: int, x: torch.Tensor, device: torch.device,
                   precision: str = "fp32") -> Callable[[], float]:  # fmt: skip
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    if precision == "bf16":  # built in bf16 as the smp variant (the same initial values), fp32 shards
        with _default_dtype(torch.bfloat16):
            module = Stack(width, layers)
        module = module.float().to(device)
    else:
        module = Stack(width, layers).to(device)
    if kind == "fsdp2":
        model: Any = plain_fsdp2(module, precision, device.type)
    else:
        model = DistributedDataParallel(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()  # the loss in fp32, as smp's DistributedModel returns fp32
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    return step


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def run_variants(width: int, layers: int, batch: int, rounds: int, steps: int, warmup: int,
                 precision: str = "fp32") -> dict[str, Any]:  # fmt: skip
    """One rank: build the variants, warm them up, then time alternating rounds (seconds per step)."""
    import smp_compat as smp

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])  # run_ranks and torchrun both set it
    smp.init({"ddp": True, "sharded_data_parallel_degree": world, **({"bf16": True} if precision == "bf16" else {})})
    from smp_compat.globalstate import state

    device = state.device
    x = torch.randn(batch // smp.dp_size(), width, device=device)
    fns = {"smp": _smp_variant(width, layers, x, precision),
           "fsdp2": _torch_variant("fsdp2", width, layers, x, device, precision)}  # fmt: skip
    if precision == "fp32":
        fns["ddp"] = _torch_variant("ddp", width, layers, x, device)
    first = {name: fn() for name, fn in fns.items()}
    for _ in range(warmup - 1):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                fns[name]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    return {"times": times, "first_losses": first}


def _gathered(result: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    args = (ns.width, ns.layers, ns.batch, ns.rounds, ns.steps, ns.warmup, ns.precision)
    names = variants(ns.precision)
    if "LOCAL_RANK" in os.environ:  # torchrun: this process is one rank; smp.init makes the NCCL/gloo group
        ranks = _gathered(run_variants(*args))
        ns.world = len(ranks)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    else:
        ranks = run_ranks(run_variants, ns.world, *args, timeout=600, env={"CUDA_VISIBLE_DEVICES": ""})
    per_round = {name: [max(r["times"][name][i] for r in ranks) for i in range(ns.rounds)] for name in names}
    ratio_fsdp = statistics.median(f / s for f, s in zip(per_round["fsdp2"], per_round["smp"]))
    ratio_ddp = statistics.median(d / s for d, s in zip(per_round["ddp"], per_round["smp"])) if "ddp" in names else None
    table = Table(title=f"Step time, world {ns.world}, MLP {ns.layers} x {ns.width}, batch {ns.batch}, {ns.precision}")
    for col in ("variant", "median ms/step", "throughput vs smp"):
        table.add_column(col, justify="right")
    for name in names:
        med = statistics.median(per_round[name])
        table.add_row(name, f"{med * 1e3:.2f}", f"{statistics.median(per_round['smp']) / med:.3f}")
    Console().print(table)
    print(f"smp / plain FSDP2 throughput (median of per-round ratios): {ratio_fsdp:.3f} (target >= 0.95)")
    if ratio_ddp is not None:
        print(f"smp / DDP throughput (median of per-round ratios): {ratio_ddp:.3f}")
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(ns), "per_round": per_round, "ratio_fsdp2": ratio_fsdp, "ratio_ddp": ratio_ddp,
                       "first_losses": ranks[0]["first_losses"]}, handle, indent=2)  # fmt: skip
    return 0 if ratio_fsdp >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
