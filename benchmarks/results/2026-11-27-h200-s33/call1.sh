#!/usr/bin/env bash
# s33a: the pair producer gating a shared stage's A on its own block's release.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
timeout 240 .gpu/moeforge_tests -tc="cuda layer*" > "$OUT/tests_new.log" 2>&1
echo "tests rc=$? at $(date -u +%T)"; tail -4 "$OUT/tests_new.log"
MODES="${MODES:-old new old new}" TAG=${TAG:-hc} SCHEDS=${SCHEDS:-benchmarks/results/2026-11-27-h200-s33/f64_r2.sched,benchmarks/results/2026-11-27-h200-s33/f64_hc_r2.sched} \
  FILTER="${FILTER:-forward/fine64/.*sched/uniform}" bash benchmarks/results/2026-11-27-h200-s32/ab.sh
