#!/usr/bin/env python3
"""Markdown table of one device run: our forward per schedule, the cuBLAS roof
measured in the same process, and torch._grouped_mm on the same shapes.

usage: python3 benchmarks/make_table.py benchmarks/results/<run>/
reads bench.json (Google Benchmark) and torch.jsonl (torch_grouped_mm.py).
"""
import json
import sys
from pathlib import Path


def main(run_dir):
    run = Path(run_dir)
    bench = json.loads((run / "bench.json").read_text())
    torch = {}
    for line in (run / "torch.jsonl").read_text().splitlines():
        t = json.loads(line)
        torch[(t["shape"], t["routing"])] = t
    rows = {}
    skipped = []
    for b in bench["benchmarks"]:
        # forward/<shape>/<schedule>/<routing>/...: a schedule file's name holds slashes of its own.
        parts = b["name"].split("/")
        at = next(i for i in range(2, len(parts)) if parts[i] in ("uniform", "skewed"))
        shape, schedule, routing = parts[1], "/".join(parts[2:at]), parts[at]
        if b.get("error_occurred"):  # a schedule that does not fit the shape (bench.log says why)
            skipped.append(f"{shape}/{schedule}/{routing}")
            continue
        rows.setdefault((shape, routing), []).append((schedule, b))
    device = next((b["label"] for b in bench["benchmarks"] if b.get("label")), "?")
    print(f"Device: {device}; date {bench['context']['date']}. ratio = cuBLAS roof time / our time (same process); "
          "the roof reads random inputs, as ours does; 'ratio, 1.0 roof' is against the roof on inputs of 1.0 "
          "(the roof before 2026-11-23: benchmarks/dense_roof.h), where a run has it.\n")
    print("| shape | routing | max/mean | schedule | ms | TFLOP/s | roof TFLOP/s | ratio | ratio, 1.0 roof "
          "| torch._grouped_mm TFLOP/s | ours / torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (shape, routing), entries in rows.items():
        best = max(entries, key=lambda e: e[1]["ratio"])
        tt = torch.get((shape, routing), {}).get("tflops")
        for schedule, b in entries:
            mark = " **(best)**" if b is best[1] else ""
            ones = b.get("roof_ones_TFLOPs")
            cells = [shape, routing, f"{b['max_over_mean']:.2f}", schedule + mark, f"{b['real_time']:.3f}",
                     f"{b['TFLOPs']:.0f}", f"{b['roof_TFLOPs']:.0f}", f"{b['ratio']:.2f}",
                     f"{b['TFLOPs'] / ones:.2f}" if ones else "n/a", f"{tt:.0f}" if tt else "n/a",
                     f"{b['TFLOPs'] / tt:.2f}" if tt else "n/a"]
            print("| " + " | ".join(cells) + " |")
    if skipped:
        print(f"\nSkipped ({len(skipped)}): " + "; ".join(sorted(skipped)))


if __name__ == "__main__":
    main(sys.argv[1])
