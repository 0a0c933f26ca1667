#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool): an A/B of two packs of
# the benchmark binaries, the old one in .gpu_old/ (scripts/device_pack.sh
# run in a checkout of the old commit, its .gpu/ carried as .gpu_old) and the
# new one in .gpu/. ROUNDS (2) rounds of old then new, one process each, for
# the forward (FORWARD_FILTER) and the training step (TRAIN_FILTER), every
# timed block after a 1 s pause; then each case's median over the rounds and
# new / old. A refactor that changes no kernel should read 1.00 within the
# spread (about 1 % for a forward, 0.3 ms for a step). Logs and JSON go to
# $OUT/ab (packed into $OUT/ab.tgz).
set -uo pipefail
. scripts/device_env.sh
R=$OUT/ab
mkdir -p "$R"
device_note "$R/device.txt"
FORWARD_FILTER=${FORWARD_FILTER:-forward/(mixtral|fine64|mbpaper)/(scattermoe|tuned_tma)/}
TRAIN_FILTER=${TRAIN_FILTER:-train/(mixtral|fine64|mbpaper)/uniform/tuned_wide/(store|lean)/}
status=0
for i in $(seq 1 "${ROUNDS:-2}"); do
  for side in old new; do
    dir=.gpu
    [ $side = old ] && dir=.gpu_old
    for bench in forward train; do
      filter=$FORWARD_FILTER
      [ $bench = train ] && filter=$TRAIN_FILTER
      [ -n "$filter" ] || continue
      LD_LIBRARY_PATH=$PWD/$dir/lib:$LD_LIBRARY_PATH MOEFORGE_BENCH_COOLDOWN_S=1 timeout 300 \
        "$dir/bench_moe_$bench" --benchmark_filter="$filter" --benchmark_out="$R/${bench}_${side}_$i.json" \
        --benchmark_out_format=json >"$R/${bench}_${side}_$i.log" 2>&1 || status=1
    done
    echo "round $i $side done at $(date -u +%T)"
  done
done
python3 - "$R" <<'PY' | tee "$R/summary.txt"
import glob, json, statistics, sys
r = sys.argv[1]
times = {}
for f in sorted(glob.glob(f"{r}/*_*_*.json")):
    side = f.rsplit("/", 1)[1].split("_")[1]
    for b in json.load(open(f))["benchmarks"]:
        name = b["run_name"].split("/iterations")[0]
        times.setdefault(name, {}).setdefault(side, []).append(b["real_time"])
print(f"{'case':55s} {'old':>9s} {'new':>9s} {'new/old':>8s}")
for name, t in sorted(times.items()):
    if "old" in t and "new" in t:
        o, n = statistics.median(t["old"]), statistics.median(t["new"])
        print(f"{name:55s} {o:9.3f} {n:9.3f} {n / o:8.3f}")
PY
(cd "$OUT" && tar czf ab.tgz ab && rm -rf ab)
exit $status
