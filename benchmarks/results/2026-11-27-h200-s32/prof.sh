#!/usr/bin/env bash
# Session 32: where the small kernels' time goes (nsys graph trace if present, ncu on each).
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
S=scratch/s32
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys=$NSYS ncu=$(command -v ncu)"
for pair in "fine64 f64_r2" "mbpaper mb_tuned_s31"; do
  set -- $pair; shape=$1; sched=$2
  if [ -n "$NSYS" ]; then
    MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_SCHEDULES=$S/$sched.sched timeout 150 "$NSYS" profile -t cuda --cuda-graph-trace=node \
      -o /tmp/nsys_$shape -f true .gpu/bench_moe_forward --benchmark_filter="forward/$shape/.*$sched.sched/uniform" > /tmp/nsys_$shape.log 2>&1
    echo "nsys $shape rc=$?"
    "$NSYS" stats -r cuda_gpu_trace -f csv -o /tmp/trace_$shape /tmp/nsys_$shape.nsys-rep > /dev/null 2>&1
    ls /tmp/trace_$shape* ; f=$(ls /tmp/trace_${shape}*.csv | head -1)
    # The last 30 kernels: start (ns), duration (ns), name.
    python3 - "$f" <<'PY' | tee "$OUT/trace_$shape.txt"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
k = [r for r in rows if r.get('Name') and 'memcpy' not in r['Name'].lower() and 'memset' not in r['Name'].lower()]
names = [r['Name'] for r in k]
# last occurrence of gemm_logits onwards, a few replays
idx = [i for i, n in enumerate(names) if 'gemm_logits' in n]
for start in idx[-3:]:
    prev_end = None
    for r in k[start:start + 8]:
        s = int(r['Start (ns)']); d = int(r['Duration (ns)'])
        gap = '' if prev_end is None else s - prev_end
        print(f"{r['Name'][:40]:40s} dur_us={d/1000:8.2f} gap_us={gap if gap == '' else gap/1000:>8}")
        prev_end = s + d
    print('--')
PY
  fi
  MOEFORGE_BENCH_ROUNDS=1 MOEFORGE_BENCH_SCHEDULES=$S/$sched.sched timeout 200 ncu --clock-control none \
    -k "regex:gemm_logits|moe_|pointwise" --launch-count 8 --section SpeedOfLight \
    .gpu/bench_moe_forward --benchmark_filter="forward/$shape/.*$sched.sched/uniform" > "$OUT/ncu_$shape.txt" 2>&1
  echo "ncu $shape rc=$?"
  grep -E "^  [a-zA-Z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|SM Frequency" "$OUT/ncu_$shape.txt" | sed -E 's/ +/ /g' | head -48
done
