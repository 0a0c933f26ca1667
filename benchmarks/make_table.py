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
    print(f"Device: {device}; date {bench['context']['date']}. ratio = cuBLAS roof time / our time (same process).\n")
    print("| shape | routing | max/mean | schedule | ms | TFLOP/s | ratio | torch._grouped_mm TFLOP/s | ours / torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (shape, routing), entries in rows.items():
        best = max(entries, key=lambda e: e[1]["ratio"])
        t = torch.get((shape, routing), {})
        for schedule, b in entries:
            mark = " **(best)**" if b is best[1] else ""
            tt = t.get("tflops")
            print(f"| {shape} | {routing} | {b['max_over_mean']:.2f} | {schedule}{mark} | {b['real_time']:.3f} | "
                  f"{b['TFLOPs']:.0f} | {b['ratio']:.2f} | {tt:.0f} | {b['TFLOPs'] / tt:.2f} |" if tt else
                  f"| {shape} | {routing} | {b['max_over_mean']:.2f} | {schedule}{mark} | {b['real_time']:.3f} | "
                  f"{b['TFLOPs']:.0f} | {b['ratio']:.2f} | n/a | n/a |")
    if skipped:
        print(f"\nSkipped ({len(skipped)}): " + "; ".join(sorted(skipped)))


if __name__ == "__main__":
    main(sys.argv[1])
