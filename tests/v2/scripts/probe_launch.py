"""An SMP v2 script's first lines, as AWS's train_lib.py has them, reporting what each rank sees (JSON per rank).

Run by tests/v2/test_v2_launch.py through ``smp-compat run``: nothing here knows smp_compat.
"""

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.sagemaker as tsm
import transformer_engine
from transformer_engine.common.recipe import DelayedScaling, Format

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--distributed_backend", default="smddp", choices=["smddp", "nccl"])
args, _ = parser.parse_known_args()

if args.distributed_backend == "smddp":
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401

dist.init_process_group(args.distributed_backend, timeout=datetime.timedelta(seconds=120))
tsm.init()
with transformer_engine.pytorch.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(Format.HYBRID),
                                             fp8_group=tsm.state.world_process_group):
    total = torch.ones(1)
    dist.all_reduce(total, group=tsm.state.tp_process_group)
s = tsm.state
report = {
    "backend": str(dist.get_backend()),
    "rank": s.rank, "tp_rank": s.tp_rank, "dp_rank": s.dp_rank, "tp_sum": total.item(),
    "hsd": s.hybrid_shard_degree, "mesh": list(s.device_mesh.mesh.shape),
    "framework": json.loads(os.environ["SM_FRAMEWORK_PARAMS"]),
    "te": transformer_engine.__name__,
}
with open(os.path.join(args.out, f"rank{s.rank}.json"), "w", encoding="utf-8") as handle:
    json.dump(report, handle)
dist.destroy_process_group()
