#!/usr/bin/env bash
# Session 30's A/B calls: bench_moe_forward processes alternating an
# experiment switch's values (MODES; the environment variable SWITCH set to
# the mode, unset for mode "off"), each one round of bursts and the steady
# state, per-step profile; before them (TESTS=1) GPU test cases (TCS). The
# calls' settings are in README.md.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
S=scratch/s30
if [ "${TESTS:-0}" = 1 ]; then
  timeout 240 .gpu/moeforge_tests --test-suite=gpu -tc="$TCS" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "ERROR|CRASH|test cases|assertions|Status" "$OUT/tests.log" | head -20
fi
for mode in $MODES; do
  i=$((${i:-0} + 1))
  if [ "$mode" != off ]; then export "$SWITCH=$mode"; else unset "$SWITCH"; fi
  log="$OUT/bench_${i}_${TAG}_$mode"
  MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES=$SCHEDS \
    timeout 150 .gpu/bench_moe_forward --benchmark_filter="$FILTER" \
    --benchmark_out="$log.json" --benchmark_out_format=json > "$log.log" 2>&1
  echo "bench $i $SWITCH=$mode rc=$? at $(date -u +%T)"
  grep -v "^profile" "$log.log" | grep -E "forward/" | sed -E 's/ +/ /g' \
    | grep -oE '^forward/[^ ]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_sm_MHz=[0-9.k]+|steady_roof_sm_MHz=[0-9.k]+|steady_ms=[0-9.]+' \
    | paste -sd' ' | sed 's/forward\//\nforward\//g'
  grep -E "^profile.*(gemm_|gather)" "$log.log" | sed -E "s/ +/ /g"
done
