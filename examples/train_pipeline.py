"""A pipeline-parallel GPT-style training script written for SageMaker's SMP v1, split over 2 ranks.

It imports ``smdistributed.modelparallel.torch`` and runs unchanged under ``smp-compat run``; with plain
``python`` (no shim on the path) it falls back to ``import smp_compat as smp``. CPU-only, a few seconds:

    smp-compat run --nproc-per-node 2 --config examples/configs/pp2.json examples/train_pipeline.py
    smp-compat run --nproc-per-node 2 --config examples/configs/pp2.json examples/train_pipeline.py --partition manual
    python examples/train_pipeline.py                # a world of one (pp = 1), default config

``--partition auto`` (the default) lets the library split the model. ``--partition manual`` shows both of
SMP's manual styles: ``with smp.partition(i):`` blocks in the model's ``__init__`` for the transformer
blocks, and ``smp.set_partition`` on the final layer norm after wrapping. The tied output head stays with
the embedding on stage 0, so a microbatch goes stage 0 -> stage 1 -> stage 0.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    import smdistributed.modelparallel.torch as smp

    SMP_IMPORT = "smdistributed.modelparallel.torch"
except ImportError:  # no SageMaker, no `smp-compat run`: use smp_compat directly
    import smp_compat as smp

    SMP_IMPORT = "smp_compat"

__all__ = [
    "SMP_IMPORT", "VOCAB", "SEQ", "Block", "TinyGPT", "make_model", "make_batches", "script_config", "init_smp",
    "lm_loss", "train_step", "eval_step", "partition_plan", "print_plan", "gather_parameters", "parse_args",
    "setup", "train", "main",
]  # fmt: skip

VOCAB, SEQ = 64, 16


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP; the mask arrives as a keyword argument."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        if attention_mask is not None:
            scores = scores + attention_mask
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, transformer blocks, final norm, output head tied to the embedding.

    The ``smp.partition`` blocks place the transformer blocks when auto_partition is off; they do
    nothing under auto_partition or before ``smp.init`` (so the plain-PyTorch reference builds it too).
    """

    def __init__(
        self, vocab: int = VOCAB, seq: int = SEQ, d: int = 64, heads: int = 4, layers: int = 4,
        dropout: float = 0.0, stages: int = 1,
    ) -> None:  # fmt: skip
        super().__init__()
        with smp.partition(0):
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList()
        for i in range(layers):
            with smp.partition(i * stages // layers):  # first half on stage 0, second half on the last stage
                self.blocks.append(Block(d, heads, dropout))
        self.ln_f = nn.LayerNorm(d)  # outside any block: default_partition, unless set_partition moves it
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: SMP keeps modules sharing a parameter on one stage
        nn.init.normal_(self.wte.weight, std=0.1)
        nn.init.normal_(self.wpe.weight, std=0.1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.drop(self.wte(input_ids) + self.wpe(torch.arange(t)))
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        return self.lm_head(self.ln_f(x))


def make_model(stages: int = 1, dropout: float = 0.0, seed: int = 0) -> TinyGPT:
    """Fixed initial weights, so every rank and the single-process reference start equal."""
    torch.manual_seed(seed)
    return TinyGPT(dropout=dropout, stages=stages)


def make_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic sequences that count up by a per-sequence stride (mod VOCAB): easy to learn, so loss falls."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        stride = torch.randint(1, 3, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def script_config(partition: str) -> dict[str, Any]:
    """The script's own smp.init dict; keys from the launcher (SM_HP_MP_PARAMETERS) override it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {
        "pipeline_parallel_degree": 2 if world >= 2 else 1,
        "microbatches": 4,
        "auto_partition": partition == "auto",
        "default_partition": 0,
        "ddp": True,
    }


def init_smp(partition: str) -> None:
    """``smp.init`` with the script's dict; the launcher's parameters win key by key, as on SageMaker."""
    if not smp.is_initialized():  # under mpirun with SM_HP_MP_PARAMETERS, importing smp initialized it
        smp.init(script_config(partition))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, a mean over tokens (so microbatch averaging gives the global-batch loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@smp.step
def train_step(model: smp.DistributedModel, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One microbatch (runs on pp_rank 0; the model's later stages run where they live)."""
    loss = lm_loss(model(input_ids), labels)
    model.backward(loss)
    return loss


@smp.step
def eval_step(model: smp.DistributedModel, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[Any, Any]:
    """Forward only; call it under torch.no_grad(). Every rank gets the same StepOutputs."""
    logits = model(input_ids)
    return lm_loss(logits, labels), logits


def _unit(name: str) -> str:
    """Display unit of a module name: ``blocks.3`` for anything inside block 3, else the top-level child."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 1 else parts[0]


def partition_plan(model: smp.DistributedModel) -> dict[str, int]:
    """{module: pp_rank} from every stage's ``local_named_modules()`` (after the first step)."""
    owners = [n for n, m in model.local_named_modules() if n and next(m.parameters(recurse=False), None) is not None]
    mine = sorted({_unit(n) for n in owners})
    plan: dict[str, int] = {}
    for pp_rank, units in enumerate(smp.allgather(mine, smp.PP_GROUP)):
        plan.update({unit: pp_rank for unit in units})
    return plan


def gather_parameters(model: smp.DistributedModel) -> dict[str, torch.Tensor]:
    """The whole model's parameters: each stage contributes its ``local_named_parameters()``."""
    local = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    merged: dict[str, torch.Tensor] = {}
    for part in smp.allgather(local, smp.PP_GROUP):
        merged.update(part)
    return merged


def print_plan(plan: dict[str, int], how: str) -> None:
    """One line per pipeline stage, listing the modules it holds."""
    print(f"partition plan ({how}):", flush=True)
    for pp_rank in sorted(set(plan.values())):
        print(f"  pp_rank {pp_rank}: {', '.join(u for u, r in plan.items() if r == pp_rank)}", flush=True)


def parse_args(description: str) -> argparse.Namespace:
    """Options shared with train_hybrid.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0, help="training-time dropout (off in eval)")
    parser.add_argument("--partition", choices=("auto", "manual"), default="auto")
    parser.add_argument("--out", help="rank 0 saves losses, eval results, final parameters and the plan here")
    return parser.parse_args()


def setup(args: argparse.Namespace) -> tuple[smp.DistributedModel, Any]:
    """``smp.init``, the wrapped model (partitioned on its first step) and the wrapped optimizer."""
    init_smp(args.partition)
    model = smp.DistributedModel(make_model(smp.pp_size(), args.dropout))
    if args.partition == "manual":
        smp.set_partition(model.get_module().ln_f, smp.pp_size() - 1)  # the other style: after wrapping
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
    return model, optimizer


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _same(value: float) -> float:
    return value


def train(
    model: smp.DistributedModel,
    optimizer: Any,
    args: argparse.Namespace,
    shard: Callable[[torch.Tensor], torch.Tensor] = _whole,
    mean: Callable[[float], float] = _same,
) -> None:
    """Train, print the plan and the losses on rank 0, evaluate in eval mode, optionally save for the tests.

    ``shard`` picks this data-parallel replica's part of a global batch and ``mean`` averages a metric over
    the replicas (train_hybrid.py); with one replica both leave their argument as it is.
    """
    losses, plan = [], {}
    for step, (x, y) in enumerate(make_batches(args.steps, args.global_batch)):
        optimizer.zero_grad()
        out = train_step(model, shard(x), shard(y))  # later stages get the same inputs and ignore them
        optimizer.step()
        losses.append(mean(out.reduce_mean().item()))  # a replica's loss is the mean over its shard
        if step == 0:
            plan = partition_plan(model)
            if smp.rank() == 0:
                print_plan(plan, "auto" if smp.state.cfg.auto_partition else "manual")
        if smp.rank() == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)

    x, y = make_batches(1, args.global_batch, seed=2)[0]
    model.eval()
    with torch.no_grad():
        eval_loss, logits = eval_step(model, shard(x), shard(y))
    model.train()
    eval_mean = mean(eval_loss.reduce_mean().item())
    accuracy = mean((logits.concat().argmax(-1) == shard(y)).float().mean().item())
    params = gather_parameters(model)
    if smp.rank() == 0:
        print(f"eval: loss {eval_mean:.6f}, next-token accuracy {accuracy:.3f}", flush=True)
        if args.out:
            result = {
                "losses": losses, "eval_loss": eval_mean, "params": params, "plan": plan,
                "config": smp.state.cfg.to_dict(), "world_size": smp.size(), "pp_size": smp.pp_size(),
                "dp_size": smp.dp_size(), "smp_import": SMP_IMPORT,
            }  # fmt: skip
            if smp.dp_size() == 1:  # with replicas, rank 0 holds only its shard's logits
                result["eval_logits"] = logits.concat()
            torch.save(result, args.out)
    smp.barrier()


def main() -> None:
    """One pipeline replica over every process (pp = 2 with two processes)."""
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    model, optimizer = setup(args)
    train(model, optimizer, args)


if __name__ == "__main__":
    main()
