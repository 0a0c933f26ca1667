#!/usr/bin/env bash
# Session 9: the producer alone looks up a persistent tile's A rows
# (tile_tma_lazy). GPU tests of the layer, then an A/B of the old and new
# benchmark binaries, alternated, with a timeline of each.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib
export MOEFORGE_CACHE_DIR=/tmp/c
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
timeout 300 .gpu/moeforge_tests -tc="cuda layer*,cuda training*" 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
export MOEFORGE_BENCH_SCHEDULES=benchmarks/schedules/s23_pair_o_persist_h.sched
F="mbpaper/benchmarks|(mixtral|fine64)/tuned_tma_persist/uniform"
for i in 1 2 3; do
  for b in bench_old bench_moe_forward; do
    echo "== $b"
    timeout 120 .gpu/$b --benchmark_filter="$F" 2>&1 | tee -a "$OUT/ab_$b.log" | grep -E "^forward" | awk '{print $1, $2, $NF}'
  done
done
for b in bench_old bench_moe_forward; do
  MOEFORGE_TIMELINE=1 timeout 100 .gpu/$b --benchmark_filter="mbpaper/benchmarks.*uniform" 2>&1 |
    tee "$OUT/timeline_$b.log" | grep "^timeline" | grep gemm_h | cut -c 60-330
done
