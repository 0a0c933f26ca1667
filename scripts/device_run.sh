#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool) from the repository root,
# with .gpu/ carried: the GPU tests, compute-sanitizer on a small case, the
# forward benchmark and PyTorch's grouped GEMM on the same shapes. Logs and
# JSON go to $OUT. Usage: bash scripts/device_run.sh [tests|bench|ours|train-torch|all]
# (ours: our benchmark with the per-step profile, without PyTorch's;
# train-torch: PyTorch's forward + backward with torch._grouped_mm only,
# needing no build: torch_train.log and torch_train.json.)
# BENCH_FILTER: a Google Benchmark filter for the forward benchmark (default all).
set -uo pipefail
what=${1:-all}
. scripts/device_env.sh
device_note "$OUT/device.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # The GPU suite in shards and memcheck: device_check.sh
  # (its logs packed into $OUT/check.tgz).
  OUT=$OUT bash scripts/device_check.sh tests || status=1
fi
if [ "$what" = bench ] || [ "$what" = ours ] || [ "$what" = all ]; then
  MOEFORGE_PROFILE=1 .gpu/bench_moe_forward --benchmark_filter="${BENCH_FILTER:-.}" \
    --benchmark_out="$OUT/bench.json" --benchmark_out_format=json \
    --benchmark_counters_tabular=true 2>&1 | tee "$OUT/bench.log" | grep -v "^profile" | tail -20
  grep "^profile" "$OUT/bench.log" > "$OUT/profile.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  PYTHONUNBUFFERED=1 python3 benchmarks/torch_grouped_mm.py 2>&1 | tee "$OUT/torch.jsonl"
fi
if [ "$what" = train-torch ]; then
  PYTHONUNBUFFERED=1 python3 benchmarks/torch_grouped_mm_train.py --out "$OUT/torch_train.json" 2>&1 |
    tee "$OUT/torch_train.log" || status=1
fi
exit $status
