"""SMP v2 expert parallelism step time: ``tsm.transform(config=MoEConfig(...))`` + the scripts' FSDP call against a
hand-written all-to-all MoE trained with plain FSDP2 on the same meshes, in the same run (issue 35, Done-when).

Both variants train the same Hugging Face Mixtral (same seed and batches, AdamW, gradient clipping at 1.0) on the
same ranks in alternating rounds:

- ``tsm``: ``tsm.init({"expert_parallel_degree": ep, "hybrid_shard_degree": world})``, ``tsm.transform(model,
  config=MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0))``, AWS's ``FullyShardedDataParallel(...)``
  call (auto-wrap on ``TransformerLayer``), ``tsm``'s ``clip_grad_norm_``;
- ``hand``: each Mixtral block replaced by a few lines of top-k routing and ``torch.distributed.nn.functional.
  all_to_all_single`` dispatch written here, ``fully_shard`` by hand (experts on their ep rank's mesh, the rest
  replicated over the ep group), experts' gradients scaled by 1/ep, ``torch.nn.utils.clip_grad_norm_`` over
  the local pieces plus an all-reduce.

Figure of merit: median over rounds of time(hand) / time(tsm), target >= 0.9. Exit status 1 when missed. Do not
read timings taken on a loaded machine.

    python benchmarks/v2_ep.py [--world 2 --ep 2 --hidden 128 --layers 2 --experts 8 --seq 128 --batch 4 --rounds 5]
    torchrun --nproc-per-node 2 benchmarks/v2_ep.py --hidden 1024 --seq 1024   # GPUs, NCCL (benchmarks/v2_gpu.sh)

Without a launcher it forks ``--world`` CPU ranks (gloo); under torchrun each rank uses its GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import smp_compat.v2  # noqa: F401 - the torch.sagemaker finder
from smp_compat.testing import run_ranks

__all__ = ["main"]


def _mixtral(ns: argparse.Namespace) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=ns.hidden * 2,
                        num_hidden_layers=ns.layers, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=ns.experts, num_experts_per_tok=2, tie_word_embeddings=False,
                        use_cache=False, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg).to(_device())


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class HandExperts(nn.Module):
    """This rank's experts (their own FSDP unit on the experts' mesh)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(w1), nn.Parameter(w2)

    def forward(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = []
        for j, x in enumerate(rows):
            g, u = F.linear(x, self.w1[j]).chunk(2, -1)
            outs.append(F.linear(F.silu(g) * u, self.w2[j]))
        return outs


class HandMoE(nn.Module):
    """Top-2 softmax routing, all-to-all to the experts' ranks and back (the baseline)."""

    def __init__(self, block: nn.Module, group: dist.ProcessGroup, ep: int, ep_rank: int) -> None:
        super().__init__()
        per = block.experts.gate_up_proj.shape[0] // ep
        self.router = nn.Parameter(block.gate.weight.detach().clone())
        rows = slice(ep_rank * per, (ep_rank + 1) * per)
        self.experts = HandExperts(block.experts.gate_up_proj.detach()[rows].clone(),
                                   block.experts.down_proj.detach()[rows].clone())  # fmt: skip
        self.group, self.ep, self.per = group, ep, per

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        x = h.reshape(-1, h.shape[-1])
        probs = torch.softmax(F.linear(x, self.router).float(), -1)
        top = torch.topk(probs, 2, -1)
        w = top.values / top.values.sum(-1, keepdim=True)
        order = torch.argsort(top.indices.flatten(), stable=True)
        counts = torch.bincount(top.indices.flatten(), minlength=self.ep * self.per).view(self.ep, self.per)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        send, recv = counts.sum(1).tolist(), got.sum(1).tolist()
        rows = all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x[order // 2], recv, send, group=self.group)
        pieces = rows.split(got.flatten().tolist())
        outs: list[Any] = [None] * len(pieces)
        ys = self.experts([torch.cat(pieces[j :: self.per]) for j in range(self.per)])
        for j, y in enumerate(ys):
            for src, part in enumerate(y.split(got[:, j].tolist())):
                outs[src * self.per + j] = part
        back = all_to_all_single(x.new_empty(sum(send), x.shape[1]), torch.cat(outs), send, recv, group=self.group)
        pairs = torch.empty_like(back)
        pairs[order] = back
        return (pairs.view(-1, 2, x.shape[1]) * w.unsqueeze(-1)).sum(1).reshape(h.shape)


def _tsm_variant(ns: argparse.Namespace) -> tuple[nn.Module, Any]:
    import functools

    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.sagemaker.moe.moe_config import MoEConfig
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    model = tsm.transform(_mixtral(ns), config=MoEConfig(moe_load_balancing="none", moe_z_loss_coeff=0.0))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 device_id=_device(), use_orig_params=True)  # fmt: skip
    return model, lambda: _clip(model)


def _clip(model: nn.Module) -> None:
    from smp_compat.v2.grad_norm import clip_grad_norm_

    clip_grad_norm_(model, 1.0)


def _hand_variant(ns: argparse.Namespace) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    world, ep, rank = dist.get_world_size(), ns.ep, dist.get_rank()
    ranks = torch.arange(world).view(1, world // ep, ep)
    kind = _device().type
    shared = DeviceMesh(kind, ranks.permute(0, 2, 1).reshape(ep, world // ep), mesh_dim_names=("rep", "shard"))
    experts = DeviceMesh(kind, ranks.permute(2, 0, 1), mesh_dim_names=("ep", "rep", "shard"))["rep", "shard"]
    group = dist.new_group(list(range(rank - rank % ep, rank - rank % ep + ep)))
    model = _mixtral(ns)
    for layer in model.model.layers:
        layer.mlp = HandMoE(layer.mlp, group, ep, rank % ep)
        for p in layer.mlp.experts.parameters():
            p.register_hook(lambda g: g / ep)  # they hold every ep peer's tokens; FSDP averages over world / ep
        fully_shard(layer.mlp.experts, mesh=experts)
        fully_shard(layer, mesh=shared)
    fully_shard(model, mesh=shared)
    return model, lambda: _hand_clip(model, ep)


def _hand_clip(model: nn.Module, ep: int) -> None:
    sq = torch.zeros((), device=_device())
    for name, p in model.named_parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            share = 1.0 if ".experts." in name else 1.0 / ep  # shared weights: ep copies of each shard
            sq += share * local.float().pow(2).sum()
    dist.all_reduce(sq)
    coef = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)


def _rank(ns: argparse.Namespace) -> dict[str, Any]:
    import torch.sagemaker as tsm

    torch.set_num_threads(1)
    tsm.init({"expert_parallel_degree": ns.ep, "hybrid_shard_degree": dist.get_world_size()})
    variants = {"tsm": _tsm_variant(ns), "hand": _hand_variant(ns)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, (m, _) in variants.items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu = {k: 0.0 for k in variants}
    losses: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(ns.rounds + 1):
        ids = torch.randint(0, ns.vocab, (ns.batch, ns.seq), generator=g).to(_device())
        for name, (model, clip) in variants.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = model(input_ids=ids, labels=ids)["loss"]
            loss.backward()
            clip()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            dist.barrier()
            if _device().type == "cuda":
                torch.cuda.synchronize()
            if rnd:  # round 0 warms up
                times[name].append(time.perf_counter() - start)
                cpu[name] += time.process_time() - start_cpu
            losses[name].append(loss.item())
    totals = torch.tensor([cpu["tsm"], cpu["hand"]], dtype=torch.float64)
    dist.all_reduce(totals)  # CPU seconds over every rank: what a loaded machine disturbs least
    return {"times": times, "losses": losses, "cpu": (totals / ns.rounds).tolist()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("world", 2), ("ep", 2), ("hidden", 128), ("layers", 2), ("experts", 8), ("seq", 128),
                          ("batch", 4), ("rounds", 5), ("vocab", 512)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    ns = p.parse_args(argv)
    if "RANK" in os.environ:  # torchrun: one GPU per rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        ns.world = dist.get_world_size()
        results = [_rank(ns)]
        if dist.get_rank() != 0:
            return 0
    else:
        results = run_ranks(_rank, ns.world, ns, timeout=1800)
    times = results[0]["times"]
    ratios = [h / t for h, t in zip(times["hand"], times["tsm"])]
    ratio = statistics.median(ratios)
    print(f"ep {ns.ep} world {ns.world} hidden {ns.hidden} layers {ns.layers} experts {ns.experts} "
          f"tokens/rank {ns.batch * ns.seq}")  # fmt: skip
    for k in ("tsm", "hand"):
        print(f"  {k:5s} step median {statistics.median(times[k]) * 1e3:8.1f} ms  first losses "
              f"{[round(x, 4) for x in results[0]['losses'][k][:3]]}")  # fmt: skip
    print(f"  time(hand) / time(tsm): median {ratio:.3f} (rounds {[round(r, 3) for r in ratios]}; target >= 0.9)")
    tsm_cpu, hand_cpu = results[0]["cpu"]
    print(f"  CPU s per step, all ranks: tsm {tsm_cpu:.3f}, hand {hand_cpu:.3f}; hand / tsm {hand_cpu / tsm_cpu:.3f}")
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
