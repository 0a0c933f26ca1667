#!/usr/bin/env bash
# Session 31's check of the raster round on the GPU: `moeforge tune` from the
# tuned schedules of mbpaper and fine64, short budgets; the run-offs it prints.
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export MOEFORGE_CACHE_DIR=/tmp/moeforge-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ >> "$OUT/device.txt"
timeout 280 .gpu/moeforge tune moe_mlp --tokens 16384 --d 1024 --f 4096 --experts 64 --topk 1 \
  --schedule scratch/s31/mbpaper_tuned.sched --budget-seconds "${MB_BUDGET:-150}" > "$OUT/mbpaper_tuned.sched" 2> "$OUT/tune_mbpaper.log"
echo "mbpaper rc=$?"
timeout 280 .gpu/moeforge tune swiglu_moe --tokens 16384 --d 2048 --f 1408 --experts 64 --topk 8 \
  --schedule scratch/s31/f64_oc.sched --budget-seconds "${F64_BUDGET:-180}" > "$OUT/fine64_tuned.sched" 2> "$OUT/tune_fine64.log"
echo "fine64 rc=$?"
grep -h -E "run-off|raster" "$OUT"/tune_*.log | cut -c1-400
tail -3 "$OUT"/tune_*.log
