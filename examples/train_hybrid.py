"""Pipeline x data parallelism (pp = 2, dp = 2, 4 processes): the GPT-style model of train_pipeline.py.

Each pipeline replica takes its shard of the global batch by ``smp.dp_rank()``; the library averages
gradients over microbatches and over the data-parallel group (``ddp: true``), so training matches one
process on the global batch. Model, data and step functions come from ``train_pipeline.py`` beside it.

    smp-compat run --config examples/configs/pp2_dp2.json examples/train_hybrid.py
    smp-compat run --config examples/configs/pp2_dp2.json examples/train_hybrid.py --partition manual
"""

from __future__ import annotations

import torch

try:
    import smdistributed.modelparallel.torch as smp
except ImportError:  # no SageMaker, no `smp-compat run`: use smp_compat directly
    import smp_compat as smp

from train_pipeline import (  # the script beside this one (its folder is on sys.path when run)
    SMP_IMPORT,
    eval_step,
    gather_parameters,
    init_smp,
    make_batches,
    make_model,
    parse_args,
    partition_plan,
    print_plan,
    train_step,
)

__all__ = ["dp_mean", "main", "shard"]


def shard(t: torch.Tensor) -> torch.Tensor:
    """This data-parallel replica's contiguous slice of a global batch."""
    per_rank = t.shape[0] // smp.dp_size()
    start = smp.dp_rank() * per_rank
    return t[start : start + per_rank]


def dp_mean(value: float) -> float:
    """The mean of a per-replica number over the data-parallel group (every replica gets it)."""
    return sum(smp.allgather(value, smp.DP_GROUP)) / smp.dp_size()


def main() -> None:
    """train_pipeline.py's loop, with each replica on its shard and metrics averaged over the DP group."""
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    init_smp(args.partition)
    model = smp.DistributedModel(make_model(smp.pp_size(), args.dropout))
    if args.partition == "manual":
        smp.set_partition(model.get_module().ln_f, smp.pp_size() - 1)
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr))
    if smp.rank() == 0:
        print(f"world {smp.size()} = pp {smp.pp_size()} x dp {smp.dp_size()}", flush=True)

    losses, plan = [], {}
    for step, (x, y) in enumerate(make_batches(args.steps, args.global_batch)):
        optimizer.zero_grad()
        out = train_step(model, shard(x), shard(y))
        optimizer.step()
        losses.append(dp_mean(out.reduce_mean().item()))  # each replica's loss is the mean over its shard
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
    eval_mean = dp_mean(eval_loss.reduce_mean().item())
    accuracy = dp_mean((logits.concat().argmax(-1) == shard(y)).float().mean().item())
    params = gather_parameters(model)
    if smp.rank() == 0:
        print(f"eval: loss {eval_mean:.6f}, next-token accuracy {accuracy:.3f}", flush=True)
        if args.out:
            torch.save(
                {
                    "losses": losses, "eval_loss": eval_mean, "params": params, "plan": plan,
                    "config": smp.state.cfg.to_dict(), "world_size": smp.size(), "pp_size": smp.pp_size(),
                    "dp_size": smp.dp_size(), "smp_import": SMP_IMPORT,
                },
                args.out,
            )  # fmt: skip
    smp.barrier()


if __name__ == "__main__":
    main()
