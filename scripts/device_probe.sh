#!/usr/bin/env bash
# Speed investigation on the GPU machine for one shape: the tile timeline of
# each schedule file given (MOEFORGE_TIMELINE build), then Nsight Compute's
# per-instruction stall sampling of one GEMM kernel and the routing kernels'
# durations. Logs go to $OUT; a short summary is printed last.
# Usage: bash scripts/device_probe.sh <shape> <kernel> <sched> [sched...]
#   shape: mixtral | fine64 | mbpaper; kernel: the GEMM to sample (gemm_h);
#   the first schedule is the one sampled.
set -uo pipefail
. scripts/device_env.sh
shape=$1
kernel=$2
shift 2
scheds=$(IFS=,; echo "$*")
first=$1
device_note "$OUT/device.txt"
MOEFORGE_PROFILE=1 MOEFORGE_TIMELINE=1 MOEFORGE_BENCH_SCHEDULES="$scheds" timeout 240 .gpu/bench_moe_forward \
  --benchmark_filter="forward/$shape/.*sched/uniform" >"$OUT/timeline.log" 2>&1
echo "timeline exit $?"
# Stall sampling per SASS instruction of one launch of $kernel (no timeline).
MOEFORGE_BENCH_SCHEDULES="$first" timeout 200 ncu --clock-control none -k "regex:^$kernel\$" --launch-skip 2 \
  --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
  --import-source no -o "$OUT/probe" -f .gpu/bench_moe_forward \
  --benchmark_filter="forward/$shape/.*$(basename "$first")/uniform" >"$OUT/ncu_run.log" 2>&1
echo "ncu exit $?"
ncu -i "$OUT/probe.ncu-rep" --page source --csv --print-source sass >"$OUT/probe_sass.csv" 2>"$OUT/probe_sass.err"
ncu -i "$OUT/probe.ncu-rep" --page details >"$OUT/probe_details.txt" 2>&1
# The routing kernels' and router GEMM's durations, one launch each.
MOEFORGE_BENCH_SCHEDULES="$first" timeout 120 ncu --clock-control none -k "regex:moe_|gemm_logits" --launch-skip 10 \
  --launch-count 5 --section SpeedOfLight .gpu/bench_moe_forward \
  --benchmark_filter="forward/$shape/.*$(basename "$first")/uniform" >"$OUT/ncu_routing.txt" 2>&1
echo "ncu routing exit $?"
grep -E "^  [a-z_]+.*\(|Duration" "$OUT/ncu_routing.txt" | head -20
grep -E "^timeline|manual_time|^profile" "$OUT/timeline.log" | cut -c1-250
wc -l "$OUT/probe_sass.csv"
