#!/usr/bin/env python3
"""The training step's bar chart, as SVG, from one results folder (standard
library only, so it runs wherever the benchmarks' JSON does).

usage: python3 benchmarks/plot_train.py <results folder> [--schedule tuned_wide] [--steady]
Reads <folder>/train.json (bench_moe_train, Google Benchmark JSON) and
<folder>/torch_train.json (torch_grouped_mm_train.py); writes
<folder>/train.svg: per shape and routing, the step in ms of moeforge (store),
of torch._grouped_mm, and of the dense cuBLAS forward+backward roof measured
in moeforge's process (the same FLOPs as dense GEMMs), each bar labelled
with its time, and moeforge's TFLOP/s under the group. --steady: the
steady-state timings instead (each side after 2 s of its own steps, at the
card's power cap, as a continuous training run is: MOEFORGE_BENCH_STEADY_S
and torch_grouped_mm_train.py --steady), which both files then must hold.
"""
import json
import sys


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    folder, schedule = args[0], "tuned_wide"
    if "--schedule" in args:
        schedule = args[args.index("--schedule") + 1]
    steady = "--steady" in args
    ours, roof, tflops = {}, {}, {}
    benchmarks = json.load(open(f"{folder}/train.json"))["benchmarks"]
    torch_rows = json.load(open(f"{folder}/torch_train.json"))["results"]
    if steady and not (all("steady_ms" in b for b in benchmarks if "ratio" in b) and
                       all("steady_ms" in r for r in torch_rows)):
        print("plot_train: --steady needs the steady-state timings in both files: bench_moe_train run with "
              "MOEFORGE_BENCH_STEADY_S=2 and torch_grouped_mm_train.py with --steady 2", file=sys.stderr)
        sys.exit(1)
    for b in benchmarks:
        parts = b["name"].split("/")  # train/<shape>/<routing>/<schedule>/<memory>/...
        if len(parts) > 4 and parts[3] == schedule and parts[4] == "store":
            k = (parts[1], parts[2])
            if steady:
                ours[k] = b["steady_ms"]
                roof[k] = b["steady_ms"] * b["ratio_steady"]  # the ratio is roof ms / ours at the steady state
                tflops[k] = b["TFLOPs"] * b["real_time"] / b["steady_ms"]
            else:
                ours[k] = b["real_time"]
                # The roof's time for the same FLOPs: ours x (our TFLOP/s / the roof's).
                roof[k] = b["real_time"] * b["TFLOPs"] / b["roof_TFLOPs"]
                tflops[k] = b["TFLOPs"]
    torch = {(r["shape"], r["routing"]): r["steady_ms" if steady else "ms"] for r in torch_rows}
    keys = [k for k in ours if k in torch]
    if not keys:
        print(f"plot_train: no case of '{schedule}' in both files", file=sys.stderr)
        sys.exit(1)
    width, bar, gap, top, height = 60 + len(keys) * 90, 24, 22, 40, 260
    scale = height / max(max(ours[k], torch[k], roof[k]) for k in keys)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + 70}" '
           'font-family="sans-serif" font-size="10">',
           f'<text x="10" y="20" font-size="13">Training step{" at the steady state" if steady else ""}, ms '
           f'(lower is better): moeforge {schedule} (blue), torch._grouped_mm (grey), dense cuBLAS roof (green); '
           'moeforge TFLOP/s below</text>']
    for i, k in enumerate(keys):
        x = 40 + i * 90
        for j, (ms, colour) in enumerate(((ours[k], "#3465a4"), (torch[k], "#888a85"), (roof[k], "#4e9a06"))):
            h = ms * scale
            bx = x + j * bar
            out.append(f'<rect x="{bx}" y="{top + height - h:.1f}" width="{bar - 2}" height="{h:.1f}" fill="{colour}"/>')
            out.append(f'<text x="{bx + bar / 2 - 1}" y="{top + height - h - 3:.1f}" text-anchor="middle">{ms:.3g}</text>')
        out.append(f'<text x="{x + bar}" y="{top + height + 14}" text-anchor="middle">{k[0]}</text>')
        out.append(f'<text x="{x + bar}" y="{top + height + 26}" text-anchor="middle">{k[1]}</text>')
        out.append(f'<text x="{x + bar}" y="{top + height + 38}" text-anchor="middle">{tflops[k]:.0f} TFLOP/s</text>')
    out.append("</svg>")
    with open(f"{folder}/train.svg", "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {folder}/train.svg ({len(keys)} cases)")


if __name__ == "__main__":
    main()
