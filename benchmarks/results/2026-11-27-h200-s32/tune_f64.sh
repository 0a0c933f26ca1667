#!/usr/bin/env bash
# Session 32: fine64's forward tuned from f64_oc (raster 8) on the last code,
# then the tuned schedule against f64_r2 at the steady state, two processes.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
S=scratch/s32
timeout 420 .gpu/moeforge tune swiglu_moe --tokens 16384 --experts 64 --topk 8 --d 2048 --f 1408 \
  --schedule $S/f64_oc.sched --budget-seconds ${BUDGET:-300} > $S/f64_tuned_s32.sched 2> /tmp/tune.log
echo "tune rc=$?"; tail -4 /tmp/tune.log; grep -v "^#" $S/f64_tuned_s32.sched | grep -E "raster|persistent|cluster|tile\(" | paste -sd' '
head -2 $S/f64_tuned_s32.sched; cp $S/f64_tuned_s32.sched "$OUT/"; tail -30 /tmp/tune.log > "$OUT/tune_tail.log"
for i in 1 2; do
  MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES=$S/f64_r2.sched,$S/f64_tuned_s32.sched \
    timeout 150 .gpu/bench_moe_forward --benchmark_filter="forward/fine64/.*(f64_r2|f64_tuned_s32).sched/" > "$OUT/bench_$i.log" 2>&1
  echo "bench $i rc=$? at $(date -u +%T)"
  grep -v "^profile" "$OUT/bench_$i.log" | grep -E "forward/" | sed -E 's/ +/ /g' \
    | grep -oE '^forward/[^ ]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_ms=[0-9.]+' \
    | paste -sd' ' | sed 's/forward\//\nforward\//g'
done
