#!/usr/bin/env bash
# s35a: deeper rings at narrower tiles (schedule files only): fine64's h at
# 128 x 64 (x 2 B) with 6 / 7 stages, its o at 128 x 128 with 6; mbpaper's
# h and o at 128 x 128 with 6 / 7, against each shape's best schedule.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
D=benchmarks/results/2026-11-27-h100-h200-s35/stages  # ran from scratch/s35, the path the logs name
F="$D/f64_r2.sched,$D/f64_h64s4.sched,$D/f64_h64s6.sched,$D/f64_h64s7.sched,$D/f64_o128s6.sched"
M="$D/mb_hs.sched,$D/mb_h128s4.sched,$D/mb_h128s6.sched,$D/mb_o128s6.sched,$D/mb_o128s7.sched,$D/mb_ho128s6.sched"
for i in 1 2; do
  MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES=$F,$M \
    timeout 280 .gpu/bench_moe_forward \
    --benchmark_filter="forward/fine64/.*f64_[a-z0-9_]+.sched/uniform/|forward/mbpaper/.*mb_[a-z0-9_]+.sched/uniform/" \
    > "$OUT/bench_$i.log" 2>&1
  echo "bench $i rc=$? at $(date -u +%T)"
  grep -E "^forward/" "$OUT/bench_$i.log" | sed -E 's/ +/ /g' \
    | grep -oE '^[a-z_]+/[^ ]+|ERROR.*|ratio_paired=[0-9.]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_ms=[0-9.]+|steady_sm_MHz=[0-9.k]+' \
    | paste -sd' ' | sed -E 's/ forward\//\nforward\//g'
  grep -E "^profile.*gemm_(h|o)" "$OUT/bench_$i.log" | sed -E "s/ +/ /g"
done
