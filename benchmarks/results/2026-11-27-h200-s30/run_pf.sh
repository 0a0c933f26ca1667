#!/usr/bin/env bash
# Session 30 (s30b): A rows prefetched into L2 MOEFORGE_PREFETCH_A k-tiles ahead (mode) against none (0).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
S=scratch/s30
if [ "${TESTS:-0}" = 1 ]; then
  timeout 240 .gpu/moeforge_tests --test-suite=gpu \
    -tc="${TCS:-cuda layer: every preset*,cuda layer: TMA B tiles*,cuda layer: MoE edge cases*,cuda layer: persistent two-block*,cuda layer: two-block clusters*,cuda training: gradients of every preset*,cuda training: wide wgmma tiles*,cuda training: persistent GEMMs*}" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "ERROR|CRASH|test cases|assertions|Status" "$OUT/tests.log" | head -20
fi
for mode in ${MODES:-0 4 0 4}; do
  i=$((${i:-0} + 1))
  if [ "$mode" != 0 ]; then export MOEFORGE_PREFETCH_A=$mode; else unset MOEFORGE_PREFETCH_A; fi
  MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=${ROUNDS:-1} MOEFORGE_BENCH_COOLDOWN_S=1 \
  MOEFORGE_BENCH_STEADY_S=${STEADY:-2} \
  MOEFORGE_BENCH_SCHEDULES=${SCHEDS:-$S/fine64_tuned.sched,$S/f64_hpc.sched,$S/mbpaper_tuned.sched} \
    timeout ${BENCH_TIMEOUT:-140} .gpu/bench_moe_forward --benchmark_filter="${FILTER:-forward/(fine64/.*f64_|fine64/.*fine64_|mbpaper/.*mbpaper_)}" \
    --benchmark_out="$OUT/bench_${i}_pf$mode.json" --benchmark_out_format=json > "$OUT/bench_${i}_pf$mode.log" 2>&1
  echo "bench $i prefetch=$mode rc=$? at $(date -u +%T)"
  grep -v "^profile" "$OUT/bench_${i}_pf$mode.log" | grep -E "forward/" | sed -E 's/ +/ /g' | grep -oE '^forward/[^ ]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_sm_MHz=[0-9.k]+|steady_roof_sm_MHz=[0-9.k]+|steady_ms=[0-9.]+' | paste -sd' ' | sed 's/forward\//\nforward\//g'
  grep -E "^profile.*gemm_" "$OUT/bench_${i}_pf$mode.log" | sed -E "s/ +/ /g"
done
