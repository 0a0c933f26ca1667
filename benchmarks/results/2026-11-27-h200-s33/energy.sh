#!/usr/bin/env bash
# s33f: burst energy per forward (instant power x time) against the steady state.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
timeout 60 .gpu/moeforge_tests -tc="*clock sampler*" > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.log"
S=benchmarks/results/2026-11-27-h200-s33
for pair in "fine64 f64_r2,f64_hp2,f64_hs,f64_hp1" "mbpaper mb_tuned_s31,mb_hs,mb_hnp,mb_hnps"; do
  set -- $pair; shape=$1; scheds=$(echo $2 | sed "s#\([a-z0-9_][a-z0-9_]*\)#$S/\1.sched#g")
  MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 MOEFORGE_BENCH_SCHEDULES=$scheds \
    timeout 200 .gpu/bench_moe_forward --benchmark_filter="forward/$shape/.*sched/uniform" > "$OUT/energy_$shape.log" 2>&1
  echo "bench $shape rc=$?"
  grep -E "^forward/" "$OUT/energy_$shape.log" | sed -E 's/ +/ /g' | while read -r line; do
    n=$(echo "$line" | cut -d' ' -f1 | sed 's#.*/s33/##;s#/iterations.*##')
    echo "$n $(echo "$line" | grep -oE '(^| )(ratio|ratio_energy|ratio_steady|mJ|roof_mJ|power_instant_W|roof_power_instant_W|sm_MHz|steady_ms)=[0-9.k]+' | paste -sd' ')"
  done
done
