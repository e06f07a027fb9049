#!/usr/bin/env bash
# SMP v2's issue-35 features on a GPU machine (CUDA, NCCL): expert parallelism, fp8 through Transformer Engine,
# and context parallelism where its benchmark exists. Nothing here runs on a CPU-only machine.
#
#   bash benchmarks/v2_gpu.sh            # from the repository root, with the package importable
#
# Needs >= 2 GPUs for the ep and cp runs (NCCL needs one GPU per rank); the fp8 check runs on one GPU and
# needs transformer_engine on a compute-capability >= 8.9 GPU (H100/H200), else it reports the stand-in.
set -u
cd "$(dirname "$0")/.."
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $GPUS"
status=0
run() { echo; echo "== $*"; timeout 900 "$@" || { echo "FAILED ($?): $*"; status=1; }; }

if [ "$GPUS" -ge 2 ]; then
  run torchrun --nproc-per-node 2 benchmarks/v2_ep.py --hidden 1024 --layers 4 --experts 8 --seq 1024 --batch 4
  [ -f benchmarks/v2_cp.py ] && run torchrun --nproc-per-node 2 benchmarks/v2_cp.py
else
  echo "skip ep/cp: one GPU (NCCL needs one GPU per rank)"
fi

FP8=$(mktemp --suffix=.py)
cat > "$FP8" <<'PY'
"""fp8: the scripts' fp8_autocast(fp8_group=tsm.state.world_process_group) and TE's checkpoint with the tracker."""
import functools
import torch, torch.distributed as dist
import smp_compat.v2  # noqa: F401
import torch.sagemaker as tsm
torch.cuda.set_device(0)
dist.init_process_group("nccl")
tsm.init({"random_seed": 1})
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format
real = not te.__name__.startswith("smp_compat")
print("transformer_engine:", "real" if real else "smp_compat stand-in (fp8 off)")
recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
layer = (te.Linear(256, 256) if real else torch.nn.Linear(256, 256)).cuda()
x = torch.randn(32, 256, device="cuda", requires_grad=True)
ckpt = functools.partial(te.checkpoint, distribute_saved_activations=False, use_reentrant=False,
                         get_rng_state_tracker=tsm.state.get_rng_state_tracker, tp_group=tsm.state.tp_process_group)
with te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=tsm.state.world_process_group):
    y = ckpt(layer, x)
y.float().sum().backward()
print("fp8 step ok: out", tuple(y.shape), "grad finite", bool(torch.isfinite(x.grad).all()))
dist.destroy_process_group()
PY
run torchrun --nproc-per-node 1 "$FP8"

run python -m pytest -q tests/v2/test_moe_routing.py tests/v2/test_v2_rng_dropout.py tests/v2/test_v2_standins.py
exit $status
