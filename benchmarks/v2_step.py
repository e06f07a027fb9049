"""SMP v2 step time at tp 2 x shard 2: ``tsm.transform`` + the scripts' FSDP call against the same training
written by hand with plain FSDP2 (``fully_shard``) and DTensor tensor parallelism (``parallelize_module``).

Both variants train the same Hugging Face Llama (same seed, same batches, AdamW, global-norm clipping at 1.0) on
the same ranks, in the same run, in alternating rounds (so machine drift hits both alike):

- ``tsm``: ``tsm.init({"tensor_parallel_degree": tp, "hybrid_shard_degree": world // tp})``,
  ``tsm.transform(model)``, then AWS's ``FullyShardedDataParallel(...)`` call (auto-wrap on
  ``TransformerLayer``, ``HYBRID_SHARD``, ``use_orig_params``, prefetch flags) and ``tsm``'s ``clip_grad_norm_``;
- ``plain``: ``parallelize_module`` on each decoder layer over the tp slice of the same root mesh (q/k/v/gate/up
  column-wise, o/down row-wise, the attention and MLP inputs prepared as replicated DTensors), ``fully_shard``
  on each decoder layer then the root over its (rep, shard) slice, and a hand-written global gradient norm
  (each DTensor piece counted once).

Figures of merit: median over rounds of time(plain) / time(tsm), target >= 0.95 (also printed: the CPU seconds
each variant's step costs on all ranks together, which a loaded machine disturbs far less); per-rank state bytes
(local parameters, gradients, AdamW state) of tsm / plain, and with ``--rss`` the peak resident set each
variant adds when it runs alone in fresh ranks, both targets within 5 %. Exit status 1 when a target is
missed. Do not read timings taken on a loaded machine.

    python benchmarks/v2_step.py [--world 4 --tp 2 --hidden 256 --layers 4 --seq 128 --batch 4 --rounds 5] [--rss]
    torchrun --nproc-per-node 4 benchmarks/v2_step.py --hidden 2048 --layers 8   # GPUs, NCCL

Without a launcher it forks ``--world`` CPU ranks (gloo, CUDA hidden); under torchrun each rank uses its GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn

import smp_compat.v2  # noqa: F401 - installs the torch.sagemaker finder the scripts import through
from smp_compat.testing import run_ranks

__all__ = ["main", "run_variants", "measure_rss", "VARIANTS"]

VARIANTS = ("tsm", "plain")
MiB = 1 << 20


def _llama(ns: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=ns.hidden * 8 // 3 // 8 * 8,
                         num_hidden_layers=ns.layers, num_attention_heads=ns.heads, num_key_value_heads=ns.kv_heads,
                         max_position_embeddings=ns.seq, tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _init(ns: argparse.Namespace) -> Any:
    import torch.sagemaker as tsm

    tsm.init({"tensor_parallel_degree": ns.tp, "hybrid_shard_degree": dist.get_world_size() // ns.tp})
    return tsm


def _device(tsm: Any) -> torch.device:
    if tsm.state.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_tsm(ns: argparse.Namespace, tsm: Any) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    """The scripts' path: transform, then FSDP1's call (served by FSDP2 after tsm.init)."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.sagemaker.grad_norm import clip_grad_norm_
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    model = tsm.transform(_llama(ns))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True, limit_all_gathers=True,
                 device_id=_device(tsm), use_orig_params=True)  # fmt: skip
    return model, lambda m: clip_grad_norm_(m, 1.0)


def build_plain(ns: argparse.Namespace, tsm: Any) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    """By hand: DTensor tp on each decoder layer, FSDP2 on each layer and the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)  # fmt: skip

    mesh = tsm.state.device_mesh
    model = _llama(ns).to(_device(tsm))
    plan = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "mlp.gate_proj", "mlp.up_proj")}  # fmt: skip
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    # each block's input once as a replicated DTensor: one backward all-reduce per block (Megatron's count)
    plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                           desired_input_kwarg_layouts={"hidden_states": Replicate()})
    plan["mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["rep", "shard"])
    fully_shard(model, mesh=mesh["rep", "shard"])
    return model, _clip_by_hand


def _clip_by_hand(model: nn.Module, max_norm: float = 1.0) -> torch.Tensor:
    """Global gradient norm over DTensor pieces: every rank sums its local squares, each divided by how many
    ranks hold the same piece (the job outside the piece's mesh, times its replicated mesh dims)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.zeros((), device=grads[0].device)
    for g in grads:
        total += g.to_local().float().pow(2).sum() / _holders(g)  # under FSDP2 every gradient is a DTensor
    dist.all_reduce(total)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([g.to_local() for g in grads], coef)
    return norm


def _holders(g: Any) -> int:
    from torch.distributed.tensor import Replicate

    mesh = g.device_mesh
    replicated = math.prod(mesh.size(d) for d, pl in enumerate(g.placements) if isinstance(pl, Replicate))
    return dist.get_world_size() // mesh.size() * replicated


def _stepper(model: nn.Module, clip: Callable[[nn.Module], Any], ids: torch.Tensor) -> Callable[[], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip(model)
        opt.step()
        return float(loss.detach())

    step.optimizer = opt  # type: ignore[attr-defined]
    return step


def _batch(ns: argparse.Namespace, tsm: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + tsm.state.dp_rank)
    return torch.randint(0, ns.vocab, (ns.batch, ns.seq), generator=g)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (local pieces of DTensors)."""

    def size(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for group in opt.param_groups for p in group["params"]]
    total = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in params)
    return total + sum(size(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def run_variants(ns: argparse.Namespace) -> dict[str, Any]:
    """One rank: build both variants, warm them up, then time alternating rounds (seconds per step)."""
    torch.set_num_threads(ns.threads)
    tsm = _init(ns)
    ids = _batch(ns, tsm)
    fns = {}
    for name, build in (("tsm", build_tsm), ("plain", build_plain)):
        fns[name] = _stepper(*build(ns, tsm), ids.to(_device(tsm)))
    first = {name: [fn() for _ in range(ns.warmup)] for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(ns.rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(ns.steps):
                fns[name]()
            if _device(tsm).type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / ns.steps)
            cpu[name].append((time.process_time() - start_cpu) / ns.steps)
    state = {name: _state_bytes(fn.optimizer) for name, fn in fns.items()}  # type: ignore[attr-defined]
    return {"times": times, "cpu": cpu, "first_losses": first, "state": state}


def measure_rss(ns: argparse.Namespace, variant: str) -> int:
    """One rank, one variant in a fresh process: the peak resident set added by building it and ``--steps`` steps."""
    torch.set_num_threads(ns.threads)
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: peak RSS follows live tensors
    tsm = _init(ns)
    ids = _batch(ns, tsm)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step = _stepper(*(build_tsm if variant == "tsm" else build_plain)(ns, tsm), ids.to(_device(tsm)))
    for _ in range(ns.steps):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("world", 4), ("tp", 2), ("hidden", 256), ("layers", 4), ("heads", 8), ("kv_heads", 4),
                          ("vocab", 2048), ("seq", 128), ("batch", 4), ("rounds", 5), ("steps", 3), ("warmup", 2),
                          ("threads", 1)):  # fmt: skip
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=default)
    parser.add_argument("--rss", action="store_true", help="also measure each variant's peak RSS in fresh ranks")
    parser.add_argument("--json", help="write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    env = {"CUDA_VISIBLE_DEVICES": ""}
    if "LOCAL_RANK" in os.environ:  # torchrun: this process is one rank
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        result = run_variants(ns)
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, result)
        ns.world = len(ranks)
        if dist.get_rank() != 0:
            return 0
    else:
        ranks = run_ranks(run_variants, ns.world, ns, timeout=1800, env=env)
    per_round = {name: [max(r["times"][name][i] for r in ranks) for i in range(ns.rounds)] for name in VARIANTS}
    ratio = statistics.median(p / t for p, t in zip(per_round["plain"], per_round["tsm"]))
    state = [r["state"]["tsm"] / r["state"]["plain"] for r in ranks]
    table = Table(title=f"SMP v2 step, world {ns.world} = tp {ns.tp} x shard {ns.world // ns.tp}, Llama "
                        f"{ns.layers} x {ns.hidden}, vocab {ns.vocab}, {ns.batch} x {ns.seq} tokens per dp rank, "
                        "fp32")  # fmt: skip
    for col in ("variant", "median ms/step", "throughput vs plain", "state MiB (rank 0)"):
        table.add_column(col, justify="right")
    for name in VARIANTS:
        med = statistics.median(per_round[name])
        table.add_row(name, f"{med * 1e3:.1f}", f"{statistics.median(per_round['plain']) / med:.3f}",
                      f"{ranks[0]['state'][name] / MiB:.2f}")  # fmt: skip
    Console().print(table)
    print(f"first losses (rank 0): {ranks[0]['first_losses']}")
    print(f"tsm / plain throughput (median of per-round ratios): {ratio:.3f} (target >= 0.95)")
    cpu = {name: statistics.median(sum(r["cpu"][name][i] for r in ranks) for i in range(ns.rounds))
           for name in VARIANTS}  # fmt: skip
    print(f"CPU seconds per step, all ranks (median over rounds; robust to a loaded machine): "
          f"tsm {cpu['tsm']:.3f}, plain {cpu['plain']:.3f}, plain / tsm {cpu['plain'] / cpu['tsm']:.3f}")
    print(f"tsm / plain per-rank state bytes: {', '.join(f'{s:.4f}' for s in state)} (target within 5 %)")
    ok = ratio >= 0.95 and all(abs(s - 1) <= 0.05 for s in state)
    rss: dict[str, list[int]] = {}
    if ns.rss and "LOCAL_RANK" not in os.environ:
        for name in VARIANTS:
            rss[name] = run_ranks(measure_rss, ns.world, ns, name, timeout=1800, env=env)
        ratios = [t / max(p, 1) for t, p in zip(rss["tsm"], rss["plain"])]
        print("peak RSS added per rank, MiB: " + "; ".join(
            f"{name} {', '.join(f'{v / MiB:.1f}' for v in values)}" for name, values in rss.items()))  # fmt: skip
        print(f"tsm / plain peak RSS added: {', '.join(f'{x:.3f}' for x in ratios)} (target within 5 %)")
        ok = ok and all(abs(x - 1) <= 0.05 for x in ratios)
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(ns), "per_round": per_round, "ratio": ratio, "cpu": cpu, "state": state, "rss": rss,
                       "first_losses": ranks[0]["first_losses"]}, handle, indent=2)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
