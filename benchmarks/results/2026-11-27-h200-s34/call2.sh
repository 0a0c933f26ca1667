#!/usr/bin/env bash
# s34b: each shape's best schedule under uniform and balanced routing (no
# expert's last tile of a few rows), per-step profile; cuBLAS's kernels for
# the expert-batched roof (Nsight Compute, one launch of each GEMM).
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
for shape in ${NCU_SHAPES-mbpaper fine64 mixtral}; do
  MOEFORGE_BENCH_ROUNDS=1 timeout 120 ncu --clock-control none --launch-count 2 --section SpeedOfLight --section LaunchStats \
    .gpu/bench_moe_forward --benchmark_filter="expert_batched/$shape/" > "$OUT/ncu_batched_$shape.txt" 2>&1
  echo "ncu $shape rc=$?"; grep -E "^  [a-zA-Z_0-9]+|Duration|Cluster Size|Grid Size|Block Size|Registers Per|Shared Memory Config|Dynamic Shared" "$OUT/ncu_batched_$shape.txt" | sed -E 's/ +/ /g' | cut -c1-150
done
S=benchmarks/results/2026-11-27-h200-s34
for i in 1 2; do
  MOEFORGE_PROFILE=1 MOEFORGE_BENCH_BALANCED=1 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES=$S/mixtral_tuned.sched,$S/f64_r2.sched,$S/mb_hs.sched \
    timeout 280 .gpu/bench_moe_forward \
    --benchmark_filter="forward/mixtral/.*mixtral_tuned.sched/(uniform|balanced)|forward/fine64/.*f64_r2.sched/(uniform|balanced)|forward/mbpaper/.*mb_hs.sched/(uniform|balanced)" \
    > "$OUT/bench_$i.log" 2>&1
  echo "bench $i rc=$? at $(date -u +%T)"
  grep -E "^forward/" "$OUT/bench_$i.log" | sed -E 's/ +/ /g' \
    | grep -oE '^[a-z_]+/[^ ]+|ERROR.*|max_over_mean=[0-9.]+|ratio_paired=[0-9.]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_ms=[0-9.]+|steady_sm_MHz=[0-9.k]+' \
    | paste -sd' ' | sed -E 's/ forward\//\nforward\//g'
  grep -E "^profile.*gemm_(h|o)" "$OUT/bench_$i.log" | sed -E "s/ +/ /g"
done
