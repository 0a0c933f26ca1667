#!/usr/bin/env bash
# Session 9, first device call: the 192-row (tall) tiles' GPU tests, then an
# A/B of s23 (main's best) against s33 (tall h) and s34 (tall h and o).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib
export MOEFORGE_CACHE_DIR=/tmp/c
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
timeout 300 .gpu/moeforge_tests -tc="*192*,*persistent two-block*,*TMA B tiles*,*k = 1 with the combine*,*every preset*" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -6
S=benchmarks/schedules
export MOEFORGE_BENCH_SCHEDULES=$S/s23_pair_o_persist_h.sched,$S/s33_absorb_h.sched,$S/s34_absorb_ho.sched
for i in 1 2; do
  timeout 200 .gpu/bench_moe_forward --benchmark_filter="mbpaper/benchmarks" --benchmark_counters_tabular=true \
    2>&1 | tee -a "$OUT/ab.log" | grep -E "^forward" | awk '{print $1, $2, $NF}'
done
MOEFORGE_TIMELINE=1 timeout 200 .gpu/bench_moe_forward --benchmark_filter="mbpaper/benchmarks.*uniform" \
  2>&1 | tee "$OUT/timeline.log" | grep "^timeline" | cut -c1-330
