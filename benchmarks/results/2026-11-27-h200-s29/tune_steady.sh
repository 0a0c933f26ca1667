#!/usr/bin/env bash
# Session 29: `moeforge tune --steady-seconds` for SHAPE from BASE, then (BENCH=1) the schedule
# found against the s26 tuned one and f64_oc at the steady state.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
declare -A layer=(
  [mbpaper]="moe_mlp --tokens 16384 --d 1024 --f 4096 --experts 64 --topk 1"
  [fine64]="swiglu_moe --tokens 16384 --d 2048 --f 1408 --experts 64 --topk 8"
  [mixtral]="swiglu_moe --tokens 8192 --d 4096 --f 14336 --experts 8 --topk 2")
S=scratch/gather
if [ "${TUNE:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout "${TUNE_TIMEOUT:-540}" .gpu/moeforge tune ${layer[$SHAPE]} --schedule "${BASE:-scattermoe}" \
    --budget-seconds "${BUDGET:-300}" --steady-seconds "${STEADY_S:-0.5}" \
    >"$OUT/${SHAPE}_steady_tuned.sched" 2>"$OUT/tune_steady_$SHAPE.log"
  echo "tune rc=$? at $(date -u +%T)"; grep -E "run-off" "$OUT/tune_steady_$SHAPE.log" | cut -c1-400; tail -2 "$OUT/tune_steady_$SHAPE.log"
  cat "$OUT/${SHAPE}_steady_tuned.sched" | head -3
fi
if [ "${BENCH:-0}" = 1 ]; then
  MOEFORGE_BENCH_ROUNDS=2 MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
  MOEFORGE_BENCH_SCHEDULES="$SCHEDS" \
    timeout 300 .gpu/bench_moe_forward --benchmark_filter="forward/$SHAPE/.*(tuned|f64_oc)" \
    --benchmark_out="$OUT/bench_steady_$SHAPE.json" --benchmark_out_format=json > "$OUT/bench_steady_$SHAPE.log" 2>&1
  echo "bench rc=$? at $(date -u +%T)"
  python3 - "$OUT/bench_steady_$SHAPE.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    n = b['name'].split('/')
    print(n[-5][-28:], n[-4], n[-3], 'ms', round(b['real_time'], 3), 'ratio', round(b['ratio'], 3), 'steady', round(b['ratio_steady'], 3),
          'cyc', round(b.get('ratio_steady_cycles', 0), 3), 'MHz', round(b['steady_sm_MHz']), '/', round(b['steady_roof_sm_MHz']))
PY
fi
