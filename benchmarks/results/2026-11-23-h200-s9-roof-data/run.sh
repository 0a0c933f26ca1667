#!/usr/bin/env bash
# Session 9: the dense roof on random inputs (as ours) beside the roof on
# inputs of 1.0 (as before), in the same process, for the best variants.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib
export MOEFORGE_CACHE_DIR=/tmp/c
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
export MOEFORGE_BENCH_SCHEDULES=benchmarks/schedules/s23_pair_o_persist_h.sched
F="mbpaper/benchmarks|mbpaper/tuned_tma_persist_pair_o|(mixtral|fine64)/(tuned_tma_pair_o|tuned_tma_persist_pair_o)"
for i in 1 2; do
  timeout 250 .gpu/bench_moe_forward --benchmark_filter="$F" --benchmark_counters_tabular=true \
    --benchmark_out="$OUT/bench$i.json" --benchmark_out_format=json 2>&1 | tee "$OUT/bench$i.log" |
    grep -E "^(forward|Benchmark)"
done
nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader
