"""Pipeline x data parallelism (pp = 2, dp = 2, 4 processes): the GPT-style model of train_pipeline.py.

Each pipeline replica takes its shard of the global batch by ``smp.dp_rank()``; the library averages
gradients over microbatches and over the data-parallel group (``ddp: true``), so training matches one
process on the global batch. Model, data, step functions and the training loop come from
``train_pipeline.py`` beside it; this script only shards the batch and averages metrics over the replicas.

    smp-compat run --config examples/configs/pp2_dp2.json examples/train_hybrid.py
    smp-compat run --config examples/configs/pp2_dp2.json examples/train_hybrid.py --partition manual
"""

from __future__ import annotations

import torch

try:
    import smdistributed.modelparallel.torch as smp
except ImportError:  # no SageMaker, no `smp-compat run`: use smp_compat directly
    import smp_compat as smp

from train_pipeline import parse_args, setup, train  # the script beside this one (its folder is on sys.path)

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
    model, optimizer = setup(args)
    if smp.rank() == 0:
        print(f"world {smp.size()} = pp {smp.pp_size()} x dp {smp.dp_size()}", flush=True)
    train(model, optimizer, args, shard=shard, mean=dp_mean)


if __name__ == "__main__":
    main()
