#!/usr/bin/env bash
# Session 29: gathered A rows by TMA (MOEFORGE_GATHER_TMA=1) against cp.async.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
S=scratch/gather
if [ "${TESTS:-1}" = 1 ]; then
  MOEFORGE_GATHER_TMA=1 timeout 200 .gpu/moeforge_tests --test-suite=gpu \
    -tc="${TCS:-cuda layer: every preset*,cuda layer: TMA B tiles*,cuda layer: MoE edge cases*,cuda layer: persistent two-block*,cuda layer: two-block clusters*}" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "ERROR|CRASH|test cases|assertions|Status" "$OUT/tests.log" | head -20
fi
for mode in ${MODES:-0 1 0 1}; do
  i=$((${i:-0} + 1))
  MOEFORGE_GATHER_TMA=$mode MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=${ROUNDS:-1} MOEFORGE_BENCH_COOLDOWN_S=1 \
  MOEFORGE_BENCH_STEADY_S=${STEADY:-2} \
  MOEFORGE_BENCH_SCHEDULES=${SCHEDS:-$S/fine64_tuned.sched,$S/mbpaper_tuned.sched,$S/mixtral_tuned.sched} \
    timeout ${BENCH_TIMEOUT:-250} .gpu/bench_moe_forward --benchmark_filter="${FILTER:-forward/(fine64/.*fine64_|mbpaper/.*mbpaper_|mixtral/.*mixtral_)}" \
    --benchmark_out="$OUT/bench_${i}_g$mode.json" --benchmark_out_format=json > "$OUT/bench_${i}_g$mode.log" 2>&1
  echo "bench $i gather=$mode rc=$? at $(date -u +%T)"
  grep -v "^profile" "$OUT/bench_${i}_g$mode.log" | grep -E "forward/" | sed -E 's/ +/ /g' | cut -c1-300
  grep -E "^profile" "$OUT/bench_${i}_g$mode.log" | sed -E "s/ +/ /g" | head -40
done
