#!/usr/bin/env bash
# The power probe (power_probe.py) on the device.
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/device_power.txt"
date -u +%Y-%m-%dT%H:%M:%SZ | tee -a "$OUT/device_power.txt"
python3 -c "import pynvml" 2>/dev/null || echo "no pynvml"
timeout 200 python3 benchmarks/results/2026-11-23-h200-s9-roof-data/power_probe.py 2>&1 | tee "$OUT/power_probe.jsonl"
