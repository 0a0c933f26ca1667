#!/usr/bin/env bash
# s35b: the GPU suite and memcheck on the tanh.approx commit, then mbpaper's
# training step (GeLU: the backward's d_x_s_a reads three tanh an element)
# with the binaries before (.gpu_old) and after (.gpu), alternating, per-step
# profile beside each.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
OUT=$OUT bash scripts/device_check.sh tests > "$OUT/check.log" 2>&1
echo "check rc=$?"; tail -14 "$OUT/check.log"
for i in 1 2; do
  for b in .gpu_old .gpu; do
    MOEFORGE_PROFILE=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 timeout 150 $b/bench_moe_train \
      --benchmark_filter="train/mbpaper/uniform/tuned_wide/(store|lean)" > "$OUT/train${b#.gpu}_$i.log" 2>&1
    echo "$b round $i rc=$? at $(date -u +%T)"
    grep -E "^train/" "$OUT/train${b#.gpu}_$i.log" | sed -E 's/ +/ /g' \
      | grep -oE '^train/[^ ]+|ratio=[0-9.]+|ratio_steady=[0-9.]+|steady_ms=[0-9.]+|fwd_ms=[0-9.]+|bwd_ms=[0-9.]+|steady_sm_MHz=[0-9.k]+' \
      | paste -sd' ' | sed -E 's/ train\//\ntrain\//g'
    grep -E "pointwise_d_x_s_a|gemm_d_h " "$OUT/train${b#.gpu}_$i.log" | sed -E "s/ +/ /g"
  done
done
