#!/bin/bash
# `smp-compat selftest` on a GPU machine, as issue 29 asks: one process over NCCL, then 2 and 4 processes
# sharing the GPU(s) over gloo (all GPUs when there are several: one process per GPU over NCCL).
# Usage, from the repository root with the package installed: bash benchmarks/selftest_gpu.sh [OUT_DIR]
# Each run has 180 s; the whole script finishes within ten minutes. Record the tables in docs/benchmarks.md.
set -u
out=${1:-selftest_gpu}
mkdir -p "$out"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
for n in 1 2 4 $([ "$gpus" -gt 4 ] && echo "$gpus"); do
  timeout 180 smp-compat selftest --nproc-per-node "$n" --json "$out/selftest_$n.json" > "$out/selftest_$n.log" 2>&1
  echo "--- $n process(es): exit $?"
  sed -n '/smp-compat selftest: [0-9]* rank/,/^backend/p;/check .*layout/,/passed,/p' "$out/selftest_$n.log"
done
