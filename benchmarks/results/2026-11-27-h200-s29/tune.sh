#!/usr/bin/env bash
# Session 29: `moeforge tune` on the H200 for SHAPE, then the schedule found
# against the s26 H100-tuned one at the steady state, ROUNDS rounds.
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
mkdir -p "$OUT/h200"
# shellcheck disable=SC2086
timeout 400 .gpu/moeforge tune ${layer[$SHAPE]} --schedule scattermoe --budget-seconds "${BUDGET:-300}" \
  >"$OUT/h200/${SHAPE}_tuned.sched" 2>"$OUT/tune_$SHAPE.log"
echo "tune rc=$? at $(date -u +%T)"; tail -3 "$OUT/tune_$SHAPE.log"
MOEFORGE_BENCH_ROUNDS=${ROUNDS:-2} MOEFORGE_BENCH_COOLDOWN_S=1 MOEFORGE_BENCH_STEADY_S=2 \
MOEFORGE_BENCH_SCHEDULES="$OUT/h200/${SHAPE}_tuned.sched,$S/${SHAPE}_tuned.sched" \
  timeout 180 .gpu/bench_moe_forward --benchmark_filter="forward/$SHAPE/.*${SHAPE}_tuned" \
  --benchmark_out="$OUT/bench_$SHAPE.json" --benchmark_out_format=json > "$OUT/bench_$SHAPE.log" 2>&1
echo "bench rc=$? at $(date -u +%T)"
python3 benchmarks/tune_summary.py "$OUT/bench_$SHAPE.json" | tail -20
python3 - "$OUT/bench_$SHAPE.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))['benchmarks']:
    n = b['name'].split('/')
    print(n[2][-40:], n[3], 'ms', round(b.get('real_time', 0), 3), 'ratio', round(b.get('ratio', 0), 3),
          'steady', round(b.get('ratio_steady', 0), 3), 'steady_ms', round(b.get('steady_ms', 0), 3),
          'MHz', round(b.get('steady_sm_MHz', 0)), '/', round(b.get('steady_roof_sm_MHz', 0)))
PY
