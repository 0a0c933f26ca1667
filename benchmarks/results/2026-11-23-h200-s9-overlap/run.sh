#!/usr/bin/env bash
# Session 9: launches overlapped (programmatic dependent launch, every
# kernel: mf::kernel_start), switched on here by MOEFORGE_OVERLAP. GPU tests
# with it, then an A/B of the same binary without and with, alternated.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib
export MOEFORGE_CACHE_DIR=/tmp/c
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
MOEFORGE_OVERLAP=1 timeout 280 .gpu/moeforge_tests -tc="cuda layer*,cuda gpu: device routing*,cuda gpu: routing replayed*" \
  2>&1 | tee "$OUT/gpu_tests_overlap.log" | tail -4
export MOEFORGE_BENCH_SCHEDULES=benchmarks/schedules/s23_pair_o_persist_h.sched
F="mbpaper/benchmarks|(mixtral|fine64)/tuned_tma_pair_o/uniform"
for i in 1 2; do
  for o in 0 1; do
    if [ $o = 1 ]; then export MOEFORGE_OVERLAP=1; else unset MOEFORGE_OVERLAP; fi
    echo "== overlap $o"
    timeout 120 .gpu/bench_moe_forward --benchmark_filter="$F" 2>&1 | tee -a "$OUT/ab_overlap$o.log" |
      grep -E "^forward" | awk '{print $1, $2, $NF}'
  done
done
