#!/usr/bin/env bash
# Session 28: the card's clocks beside each timed forward and its paired roof.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,power.default_limit --format=csv | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE,TEMPERATURE > "$OUT/smi_before.txt" 2>&1
S=scratch/clk
MOEFORGE_PROFILE=1 MOEFORGE_BENCH_ROUNDS=${ROUNDS:-2} MOEFORGE_BENCH_COOLDOWN_S=1 \
MOEFORGE_BENCH_SCHEDULES=${SCHEDS:-$S/mixtral_tuned.sched,$S/fine64_tuned.sched,$S/fine64_hp.sched,$S/mbpaper_tuned.sched} \
  .gpu/bench_moe_forward --benchmark_filter="${FILTER:-forward/(mixtral/.*mixtral_|fine64/.*fine64_|mbpaper/.*mbpaper_)}" \
  --benchmark_out="$OUT/bench.json" --benchmark_out_format=json > "$OUT/clocks.log" 2>&1
echo "bench rc=$?"
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE,TEMPERATURE > "$OUT/smi_after.txt" 2>&1
grep -v "^profile" "$OUT/clocks.log" | grep -E "forward/|no clock" | sed -E 's/ +/ /g' | cut -c1-600
