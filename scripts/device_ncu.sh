#!/usr/bin/env bash
# Nsight Compute on the GPU machine: our expert GEMMs and cuBLAS's kernels
# for one benchmark case, with the sections that say what bounds a GEMM.
# Usage: bash scripts/device_ncu.sh [benchmark filter]
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
filter=${1:-forward/mixtral/tuned/uniform}
timeout 500 ncu --clock-control none -k regex:gemm --launch-count 8 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats \
  .gpu/bench_moe_forward --benchmark_filter="$filter" >"$OUT/ncu.txt" 2>&1
echo "ncu exit $?"
grep -E "^  [a-z_0-9]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Executed Ipc Active|Issue Slots Busy|Shared Memory" "$OUT/ncu.txt" | head -120
