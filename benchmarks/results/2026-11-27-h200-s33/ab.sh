#!/usr/bin/env bash
# Session 32's A/B calls: bench_moe_forward processes alternating two builds
# (MODES: "old" runs .gpu_old, "new" runs .gpu), each one round of bursts and
# the steady state, per-step profile; optional ncu of the routing kernels.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
if [ "${NCU:-0}" = 1 ]; then
  for b in old new; do
    bin=.gpu; [ $b = old ] && bin=.gpu_old
    for pair in "fine64 f64_r2" "mbpaper mb_tuned_s31"; do
      set -- $pair; shape=$1; sched=$2
      LD_LIBRARY_PATH=$PWD/$bin/lib:/usr/local/cuda/lib64 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_SCHEDULES=scratch/s32/$sched.sched \
      timeout 120 ncu --clock-control none -k "regex:gemm_logits|moe_" --launch-count 4 --section SpeedOfLight \
        $bin/bench_moe_forward --benchmark_filter="forward/$shape/.*$sched.sched/uniform" > /tmp/ncu_${b}_$shape.txt 2>&1
      echo "ncu $b $shape: $(grep -E '^  [a-z_0-9]+ \(|Duration' /tmp/ncu_${b}_$shape.txt | sed -E 's/ +/ /g;s/\(([0-9]+), 1, 1\)x\(([0-9]+), 1, 1\).*/\1x\2/' | paste -sd' ')"
    done
  done
fi
for mode in $MODES; do
  i=$((${i:-0} + 1))
  bin=.gpu; [ "$mode" = old ] && bin=.gpu_old
  log="$OUT/bench_${i}_${TAG}_$mode"
  LD_LIBRARY_PATH=$PWD/$bin/lib:/usr/local/cuda/lib64 MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES=$SCHEDS \
    timeout 150 $bin/bench_moe_forward --benchmark_filter="$FILTER" > "$log.log" 2>&1
  echo "bench $i $mode rc=$? at $(date -u +%T)"
  grep -v "^profile" "$log.log" | grep -E "forward/" | sed -E 's/ +/ /g' \
    | grep -oE '^forward/[^ ]+|ratio_steady=[0-9.]+|ratio_steady_cycles=[0-9.]+|steady_ms=[0-9.]+' \
    | paste -sd' ' | sed 's/forward\//\nforward\//g'
  grep -E "^profile.*(route|logits)" "$log.log" | sed -E "s/ +/ /g" | head -8
done
