#!/usr/bin/env bash
# Session 29: Nsight Compute on mbpaper's and fine64's tuned expert GEMMs and the roof's kernels.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/device.txt"; date -u +%FT%TZ | tee -a "$OUT/device.txt"
S=scratch/gather
for shape in ${SHAPES:-mbpaper fine64}; do
  for k in "gemm_h|gemm_o" "nvjet|xmma"; do
    tag=${shape}_$( [ "$k" = "gemm_h|gemm_o" ] && echo ours || echo roof )
    MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_SCHEDULES=$S/${shape}_tuned.sched timeout 240 ncu --clock-control none \
      -k "regex:$k" --launch-count 2 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
      --metrics lts__t_bytes.sum.per_second,dram__bytes_read.sum.per_second,dram__bytes_write.sum.per_second,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      .gpu/bench_moe_forward --benchmark_filter="forward/$shape/.*${shape}_tuned.sched/uniform" >"$OUT/ncu_$tag.txt" 2>&1
    echo "$tag rc=$? at $(date -u +%T)"
    grep -E "^  [a-zA-Z_0-9]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|lts__t_bytes|dram__bytes|hit_rate|hmma|SM Frequency" "$OUT/ncu_$tag.txt" | sed -E 's/ +/ /g' | head -40
  done
done
