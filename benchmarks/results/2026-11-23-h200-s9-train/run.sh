#!/usr/bin/env bash
# Session 9: the training step against the forward+backward roof on random
# inputs (dense_roof.h since 2026-11-23), scattermoe and tuned_wide, store.
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=$PWD/.gpu/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib
export MOEFORGE_CACHE_DIR=/tmp/c
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/device.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device.txt"
timeout 500 .gpu/bench_moe_train --benchmark_filter="/(scattermoe|tuned_wide)/store" --benchmark_counters_tabular=true \
  --benchmark_out="$OUT/train.json" --benchmark_out_format=json 2>&1 | tee "$OUT/train.log" | grep -E "^(train|Bench)"
