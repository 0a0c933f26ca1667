#!/usr/bin/env bash
# Nsight Compute on the GPU machine: our kernels and cuBLAS's for one
# benchmark case, with the sections that say what bounds a GEMM (speed of
# light, L2 and DRAM traffic, pipe use, warp stalls).
# Usage: bash scripts/device_ncu.sh [benchmark filter] [kernel regex] [launches] [tag]
#   kernel regex: ours are gemm_<func>; cuBLAS's are nvjet* / sm90_xmma* on
#   Hopper (default: both, ours first). BENCH: the benchmark binary in .gpu/
#   (default bench_moe_forward; bench_moe_train for the training step's
#   kernels, filter e.g. train/fine64/uniform/default/store).
set -uo pipefail
. scripts/device_env.sh
filter=${1:-forward/mixtral/tuned_tma/uniform}
kernels=${2:-gemm|nvjet|xmma}
launches=${3:-8}
tag=${4:-ncu}
bench=${BENCH:-bench_moe_forward}
timeout 500 ncu --clock-control none -k "regex:$kernels" --launch-count "$launches" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats \
  --metrics lts__t_bytes.sum.per_second,dram__bytes_read.sum.per_second,lts__t_sector_hit_rate.pct \
  .gpu/$bench --benchmark_filter="$filter" >"$OUT/$tag.txt" 2>&1
echo "ncu exit $?"
grep -E "^  [a-zA-Z_0-9]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|lts__t_bytes|dram__bytes_read|hit_rate|Executed Ipc Active|Issue Slots Busy|Stall" "$OUT/$tag.txt" | head -80
