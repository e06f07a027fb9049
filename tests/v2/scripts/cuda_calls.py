"""The torch.cuda calls AWS's SMP v2 scripts make unguarded (train_lib.py, memory_tracker.py, checkpoints.py), as
they make them, on a machine without CUDA: one FSDP step, then a JSON report per rank.

Run by tests/cli/test_cuda_on_cpu.py through ``smp-compat run``: nothing here knows smp_compat.
"""

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.sagemaker as tsm
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args, _ = parser.parse_known_args()

torch.set_num_threads(1)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
global_rank = dist.get_rank()
device = global_rank % torch.cuda.device_count()  # train_lib.py
tsm.init()
torch.cuda.manual_seed_all(1)
torch.cuda.set_device(device)
torch.manual_seed(0)
model = FSDP(torch.nn.Linear(4, 2), device_id=torch.cuda.current_device())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
torch.cuda.cudart().cudaProfilerStart()
torch.cuda.nvtx.range_push("iteration0")
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("forward")
loss = model(torch.full((3, 4), float(global_rank + 1))).square().mean()
torch.cuda.nvtx.range_pop()
loss.backward()
optimizer.step()
torch.cuda.empty_cache()
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
memory = [torch.cuda.memory_allocated(device=device), torch.cuda.max_memory_allocated(device=device),
          torch.cuda.memory_reserved(device=device), torch.cuda.max_memory_reserved(device=device)]
torch.cuda.reset_peak_memory_stats()  # memory_tracker.py
report = {
    "device": device,
    "current_device": torch.cuda.current_device(),
    "is_available": torch.cuda.is_available(),
    "param_device": str(next(model.parameters()).device),
    "memory": memory,
    "loss": loss.item(),
}
with open(os.path.join(args.out, f"rank{global_rank}.json"), "w", encoding="utf-8") as handle:
    json.dump(report, handle)
dist.destroy_process_group()
