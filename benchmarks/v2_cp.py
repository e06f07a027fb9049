"""SMP v2 context parallelism at cp 2 on CPU: attention step time and per-rank activation memory against the
unsplit computation, at a context long enough to matter (>= 2048 tokens).

Two measurements, each unsplit (one process, the whole sequence) against cp 2 (two forked gloo ranks, the
scripts' head/tail chunks), for both ``cp_comm_type`` values:

- ``attention``: causal attention forward + backward of (B, H, S, D) fp32 queries/keys/values; unsplit is
  PyTorch's ``scaled_dot_product_attention(is_causal=True)``, as Hugging Face's ``sdpa`` runs it;
- ``model``: one forward + backward of a small Hugging Face Llama (sdpa attention unsplit; tsm.transform's
  context parallelism at cp 2), with labels, no activation checkpointing.

Activation memory is what autograd keeps for the backward: the bytes of the distinct tensors packed by a
``saved_tensors_hooks`` probe during the forward, parameters excluded. Time is the median of ``--rounds``
forward + backward rounds (cp 2: the slower rank). Target: activation memory per rank <= 0.6 of unsplit.
Exit status 1 when a target is missed. Timings on a loaded machine are indicative only.

    python benchmarks/v2_cp.py [--seq 4096 --heads 8 --head-dim 64 --rounds 3 --hidden 256 --layers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import smp_compat.v2  # noqa: F401 - installs the torch.sagemaker finder
from smp_compat.testing import run_ranks
from smp_compat.v2.context_parallel import split_for_cp_rank

TARGET = 0.6
MiB = 1 << 20


def saved_bytes(fn: Callable[[], torch.Tensor], exclude: set[int]) -> tuple[int, torch.Tensor]:
    """Run ``fn`` (a forward) and count the bytes of the distinct storages autograd saves for its backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def _timed(step: Callable[[], None], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _qkv(ns: argparse.Namespace) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(1, ns.heads, ns.seq, ns.head_dim) for _ in range(3)]


def attention_unsplit(ns: argparse.Namespace) -> dict[str, float]:
    q, k, v = (t.requires_grad_() for t in _qkv(ns))
    forward = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    memory, _ = saved_bytes(forward, set())
    return {"time": _timed(lambda: forward().sum().backward(), ns.rounds), "memory": memory}


def attention_cp(ns: argparse.Namespace, comm: str) -> dict[str, float]:
    from smp_compat.v2.context_parallel.attention import CpGroup, context_parallel_attention

    torch.set_num_threads(ns.threads)
    cp = CpGroup.of(dist.group.WORLD, comm)
    q, k, v = (split_for_cp_rank(t, cp.size, cp.rank, 2).requires_grad_() for t in _qkv(ns))
    forward = lambda: context_parallel_attention(q, k, v, ns.head_dim**-0.5, cp)  # noqa: E731
    memory, _ = saved_bytes(forward, set())
    return {"time": _timed(lambda: forward().sum().backward(), ns.rounds), "memory": memory}


def _llama(ns: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=2 * ns.hidden,
                         num_hidden_layers=ns.layers, num_attention_heads=ns.heads, num_key_value_heads=ns.heads,
                         max_position_embeddings=ns.seq, tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _ids(ns: argparse.Namespace) -> torch.Tensor:
    return torch.randint(0, ns.vocab, (1, ns.seq), generator=torch.Generator().manual_seed(1))


def _model_run(model: torch.nn.Module, ids: torch.Tensor, rounds: int) -> dict[str, float]:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    memory, _ = saved_bytes(lambda: model(input_ids=ids, labels=ids)["loss"], params)
    return {"time": _timed(lambda: model(input_ids=ids, labels=ids)["loss"].backward(), rounds), "memory": memory}


def model_unsplit(ns: argparse.Namespace) -> dict[str, float]:
    return _model_run(_llama(ns), _ids(ns), ns.rounds)


def model_cp(ns: argparse.Namespace, comm: str) -> dict[str, float]:
    import torch.sagemaker as tsm

    torch.set_num_threads(ns.threads)
    tsm.init({"hybrid_shard_degree": 2, "context_parallel_degree": 2})
    model = tsm.transform(_llama(ns), cp_comm_type=comm)
    return _model_run(model, split_for_cp_rank(_ids(ns), 2, tsm.state.cp_rank), ns.rounds)


def _cp(fn: Callable[..., dict[str, float]], ns: argparse.Namespace, comm: str) -> dict[str, float]:
    ranks = run_ranks(fn, 2, ns, comm, timeout=1800, threads_per_rank=ns.threads)
    return {"time": max(r["time"] for r in ranks), "memory": max(r["memory"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (unsplit and each rank)")
    ns = parser.parse_args(argv)
    torch.set_num_threads(ns.threads)
    rows: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []
    for what, unsplit, cp_fn in (("attention", attention_unsplit, attention_cp), ("model", model_unsplit, model_cp)):
        base = unsplit(ns)
        for comm in ("p2p", "all_gather"):
            rows.append((what, comm, base, _cp(cp_fn, ns, comm)))
    print(f"seq {ns.seq}, heads {ns.heads} x {ns.head_dim}, model hidden {ns.hidden} x {ns.layers} layers, "
          f"vocab {ns.vocab}, {ns.threads} thread(s) per process, median of {ns.rounds}")  # fmt: skip
    print(f"{'':10} {'comm':10} {'unsplit s':>10} {'cp2 s':>8} {'unsplit MiB':>12} {'cp2 MiB/rank':>13} {'ratio':>6}")
    ok = True
    for what, comm, base, cp in rows:
        ratio = cp["memory"] / base["memory"]
        ok &= ratio <= TARGET
        print(f"{what:10} {comm:10} {base['time']:10.3f} {cp['time']:8.3f} {base['memory'] / MiB:12.1f} "
              f"{cp['memory'] / MiB:13.1f} {ratio:6.2f}")  # fmt: skip
    print(f"target: activation memory per rank <= {TARGET} of unsplit: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
