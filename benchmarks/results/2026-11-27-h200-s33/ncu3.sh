#!/usr/bin/env bash
# s33c: why a pair of h blocks (B multicast) loses cycles: gemm_h under Nsight
# Compute, one launch each (warm, caches flushed): f64_r2 (a block per tile),
# f64_hc_r2 (persistent pairs) on the old build and on the s33a build.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
S=benchmarks/results/2026-11-27-h200-s33
for run in "old f64_r2" "old f64_hc_r2" "new f64_hc_r2"; do
  set -- $run; b=$1; sched=$2; bin=.gpu; [ $b = old ] && bin=.gpu_old
  LD_LIBRARY_PATH=$PWD/$bin/lib:/usr/local/cuda/lib64 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_SCHEDULES=$S/$sched.sched \
    timeout 150 ncu --clock-control none -k "regex:gemm_h" --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    --export /tmp/h_${b}_$sched -f $bin/bench_moe_forward --benchmark_filter="forward/fine64/.*/$sched.sched/uniform" > /tmp/ncu_${b}_$sched.log 2>&1
  echo "ncu $b $sched rc=$?"
  ncu --import /tmp/h_${b}_$sched.ncu-rep --page details > "$OUT/details_${b}_$sched.txt" 2>&1
  ncu --import /tmp/h_${b}_$sched.ncu-rep --page source --csv --print-source sass > /tmp/sass_${b}_$sched.csv 2>&1
  gzip -c /tmp/sass_${b}_$sched.csv > "$OUT/sass_${b}_$sched.csv.gz"
  grep -E "Duration|SM Frequency|Compute \(SM\) Thr|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Warp Cycles Per Issued|Issued Warp|No Eligible|One or More" "$OUT/details_${b}_$sched.txt" | sed -E 's/ +/ /g' | head -14
done
