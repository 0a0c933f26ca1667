#!/usr/bin/env bash
# Session 30 (s30c): the padded copy with four chunks a thread (mode 0) against one (mode 1, MOEFORGE_GATHER_U1).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
S=scratch/s30
if [ "${TESTS:-1}" = 1 ]; then
  timeout 240 .gpu/moeforge_tests --test-suite=gpu \
    -tc="${TCS:-cuda layer: every preset*,cuda training: gradients of every preset*}" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "ERROR|CRASH|test cases|assertions|Status" "$OUT/tests.log" | head -20
fi
for mode in ${MODES:-1 0 1 0}; do
  i=$((${i:-0} + 1))
  if [ "$mode" != 0 ]; then export MOEFORGE_GATHER_U1=1; else unset MOEFORGE_GATHER_U1; fi
  MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=${ROUNDS:-1} MOEFORGE_BENCH_COOLDOWN_S=1 \
  MOEFORGE_BENCH_STEADY_S=${STEADY:-2} \
  MOEFORGE_BENCH_SCHEDULES=${SCHEDS:-$S/f64_oc.sched,$S/f64_blk_hpc_oc.sched,$S/mixtral_tuned.sched} \
    timeout ${BENCH_TIMEOUT:-140} .gpu/bench_moe_forward --benchmark_filter="${FILTER:-forward/(fine64/.*f64_|mixtral/.*mixtral_)}" \
    --benchmark_out="$OUT/bench_${i}_u1$mode.json" --benchmark_out_format=json > "$OUT/bench_${i}_u1$mode.log" 2>&1
  echo "bench $i u1=$mode rc=$? at $(date -u +%T)"
  grep -v "^profile" "$OUT/bench_${i}_u1$mode.log" | grep -E "forward/" | sed -E 's/ +/ /g' | grep -oE '^forward/[^ ]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_sm_MHz=[0-9.k]+|steady_roof_sm_MHz=[0-9.k]+|steady_ms=[0-9.]+' | paste -sd' ' | sed 's/forward\//\nforward\//g'
  grep -E "^profile.*gemm_" "$OUT/bench_${i}_u1$mode.log" | sed -E "s/ +/ /g"
done
