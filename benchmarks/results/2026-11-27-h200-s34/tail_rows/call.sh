#!/usr/bin/env bash
# s34c experiment: an expert's last <= TAIL rows computed by the tile before
# them (MOEFORGE_EXPERIMENT_TAIL), correctness then mbpaper A/B.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
S=scratch/s34
for t in 8; do
  for shape in "--tokens 2048 --d 512 --f 1024 --experts 16 --topk 1" "--tokens 4096 --d 256 --f 512 --experts 32 --topk 1" "--tokens 3000 --d 512 --f 768 --experts 8 --topk 2"; do
    for seed in 1; do
      MOEFORGE_EXPERIMENT_TAIL=$t timeout 120 .gpu/moeforge run moe_mlp $shape --seed $seed --schedule scratch/s33/mb_tuned_s31.sched --backend cuda --check=full > /tmp/run.log 2>&1
      echo "tail $t [$shape] seed $seed rc=$? $(grep -E '^check' /tmp/run.log | grep -oE '^check +[a-z_]+|[0-9.e-]+ \(tol|PASS|FAIL' | paste -sd' ')"
    done
  done
done
# MOEFORGE_EXPERIMENT_TAIL=8 timeout 200 .gpu/moeforge_tests -tc="cuda layer*,cuda forward*" > "$OUT/tests_tail8.log" 2>&1
# (the cuda layer cases ran in the previous call)
for t in 0 8 0 8; do
  i=$((${i:-0} + 1))
  MOEFORGE_EXPERIMENT_TAIL=$t MOEFORGE_PROFILE=1 MOEFORGE_BENCH_BALANCED=1 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES=scratch/s33/mb_tuned_s31.sched \
    timeout 150 .gpu/bench_moe_forward --benchmark_filter="forward/mbpaper/.*mb_tuned_s31.sched/" > "$OUT/bench_${i}_tail$t.log" 2>&1
  echo "bench $i tail $t rc=$? at $(date -u +%T)"
  grep -E "^forward/" "$OUT/bench_${i}_tail$t.log" | sed -E 's/ +/ /g' \
    | grep -oE '^[a-z_]+/[^ ]+|ERROR.*|ratio_paired=[0-9.]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_ms=[0-9.]+|steady_sm_MHz=[0-9.k]+' \
    | paste -sd' ' | sed -E 's/ forward\//\nforward\//g' | sed 's#forward/mbpaper/scratch/s33/##'
  grep -E "^profile.*gemm_h" "$OUT/bench_${i}_tail$t.log" | sed -E "s/ +/ /g;s/profile mbpaper scratch.s33.//"
done
