#!/usr/bin/env bash
# Session 33: the training step, ours and torch._grouped_mm's, at the card's steady state.
set -uo pipefail
. scripts/device_env.sh
device_note "$OUT/device.txt"
MOEFORGE_BENCH_STEADY_S=2 MOEFORGE_BENCH_COOLDOWN_S=1 timeout 330 .gpu/bench_moe_train \
  --benchmark_filter="${FILTER:-train/(mixtral|fine64|mbpaper|qwen3moe|gptoss)/(uniform|skewed)/tuned_wide/(store|lean)/}" \
  --benchmark_out="$OUT/train.json" --benchmark_out_format=json > "$OUT/train.log" 2>&1
echo "train rc=$?"
PYTHONUNBUFFERED=1 timeout 210 python3 benchmarks/torch_grouped_mm_train.py --shapes mixtral,fine64,mbpaper,qwen3moe,gptoss \
  --cooldown 1 --steady 2 --out "$OUT/torch_train.json" > "$OUT/torch_train.log" 2>&1
echo "torch rc=$?"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
d = json.load(open(f"{out}/train.json"))
for b in d["benchmarks"]:
    if "ratio" not in b: continue
    g = lambda k: b.get(k, float("nan"))
    print(f"{b['name'].split('/iterations')[0]:48s} {g('real_time'):.2f} ms ratio {g('ratio'):.3f} | steady {g('steady_ms'):.2f} ms ratio {g('ratio_steady'):.3f} cyc {g('ratio_steady_cycles'):.3f} MHz {g('steady_sm_MHz'):.0f}/{g('steady_roof_sm_MHz'):.0f} pcap {g('steady_pcap_pct'):.0f}/{g('steady_roof_pcap_pct'):.0f} roofTF {g('steady_roof_TFLOPs'):.0f}")
try:
    t = json.load(open(f"{out}/torch_train.json"))
    rows = t["results"] if isinstance(t, dict) and "results" in t else t
    for r in rows:
        print("torch", r.get("shape"), r.get("routing"), "ms", r.get("ms"), "steady_ms", r.get("steady_ms"), r.get("error", ""))
except Exception as e:
    print("torch json:", e)
PY
