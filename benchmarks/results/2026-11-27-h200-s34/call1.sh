#!/usr/bin/env bash
# s34a: the expert-batched roof (cuBLAS, per-expert weights, equal rows, no
# routing) beside the dense roof and each shape's best schedule.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64
timeout 60 .gpu/moeforge_tests -tc="*cuBLAS*" > "$OUT/tests_cublas.log" 2>&1
echo "tests rc=$? at $(date -u +%T)"; tail -3 "$OUT/tests_cublas.log"
for shape in mixtral fine64 mbpaper; do
  MOEFORGE_BENCH_ROUNDS=1 timeout 120 ncu --clock-control none --launch-count 2 --section SpeedOfLight \
    .gpu/bench_moe_forward --benchmark_filter="expert_batched/$shape/" > "$OUT/ncu_batched_$shape.txt" 2>&1
  echo "ncu $shape rc=$?: $(grep -E '^  [a-zA-Z_0-9]+.*\(|Duration' "$OUT/ncu_batched_$shape.txt" | sed -E 's/ +/ /g' | cut -c1-160 | paste -sd' ')"
done
S=benchmarks/results/2026-11-27-h200-s34
for i in 1 2; do
  MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES=$S/mixtral_tuned.sched,$S/f64_r2.sched,$S/mb_hs.sched \
    timeout 240 .gpu/bench_moe_forward \
    --benchmark_filter="expert_batched/|forward/mixtral/.*mixtral_tuned|forward/fine64/.*f64_r2|forward/mbpaper/.*mb_hs" \
    > "$OUT/bench_$i.log" 2>&1
  echo "bench $i rc=$? at $(date -u +%T)"
  grep -E "^(expert_batched|forward)/" "$OUT/bench_$i.log" | sed -E 's/ +/ /g' \
    | grep -oE '^[a-z_]+/[^ ]+|ratio_paired=[0-9.]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_ms=[0-9.]+|steady_sm_MHz=[0-9.k]+' \
    | paste -sd' ' | sed -E 's/ (expert_batched|forward)\//\n\1\//g'
done
