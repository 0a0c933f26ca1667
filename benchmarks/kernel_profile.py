#!/usr/bin/env python3
"""The kernels of one layer's training step, side by side for moeforge's
module, SonicMoE and a torch._grouped_mm layer: the same layer as
torch_stack_train.py builds it (same weights, same input), its forward and
backward from one upstream gradient, recorded by torch.profiler (CUPTI's
kernel records: Nsight Systems does not run on the GPU machine) over
--steps steps after a warm-up and a second of the implementation's own
steps (the card's steady clock).

Per implementation: each kernel's GPU time per step (its launches summed,
by name), its share of the step's kernel time, and the step's wall time by
CUDA events beside the kernel sum (the gap is launch and host time). Names
are shortened to their first --width characters; `--json` writes the full
rows.

usage: python3 benchmarks/kernel_profile.py [--shape fine64] [--impls moeforge,sonicmoe,torch]
       [--steps 5] [--width 70] [--json out.json]
"""
import argparse
import collections
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_stack_train as stack  # noqa: E402


def profile(impl, shape, steps, steady):
    T, d, f, E, k = stack.SHAPES[shape]
    dev = torch.device("cuda")
    layer = stack.make_layer(impl, 100, (T, d, f, E, k), dev, "auto")
    g = torch.Generator(device=dev).manual_seed(7)
    x = ((torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()).requires_grad_()
    dy = (torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).to(dy.dtype).backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < steady:
        step()
        torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            a.record()
            step()
            b.record()
            b.synchronize()
            wall.append(a.elapsed_time(b))
    kernels = collections.defaultdict(lambda: [0.0, 0])  # name -> [us, launches]
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name and "Memset" not in e.name:
            kernels[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            kernels[e.name][1] += 1
    rows = [{"kernel": n, "ms_per_step": us / 1000 / steps, "launches_per_step": c / steps}
            for n, (us, c) in kernels.items()]
    rows.sort(key=lambda r: -r["ms_per_step"])
    del layer, x, dy
    torch.cuda.empty_cache()
    return {"impl": stack.impl_label(impl), "shape": shape, "wall_ms": sorted(wall)[len(wall) // 2], "kernels": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="fine64")
    ap.add_argument("--impls", default="moeforge,sonicmoe,torch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--steady", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=70)
    ap.add_argument("--json")
    a = ap.parse_args()
    impls = a.impls.split(",")
    if "sonicmoe" in impls:
        try:
            import sonicmoe  # noqa: F401
        except ImportError as e:
            print(f"kernel_profile: SonicMoE is not installed ({e}); skipping it", file=sys.stderr)
            impls.remove("sonicmoe")
    out = []
    for impl in impls:
        r = profile(impl, a.shape, a.steps, a.steady)
        out.append(r)
        total = sum(k["ms_per_step"] for k in r["kernels"])
        print(f"\n{r['impl']} {a.shape}: step {r['wall_ms']:.2f} ms (events, median), kernels {total:.2f} ms "
              f"in {sum(k['launches_per_step'] for k in r['kernels']):.0f} launches")
        for k in r["kernels"]:
            if k["ms_per_step"] < 0.005:
                continue
            print(f"  {k['ms_per_step']:8.3f} ms {100 * k['ms_per_step'] / total:5.1f} % "
                  f"x{k['launches_per_step']:<4.0f} {k['kernel'][:a.width]}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                       "torch": torch.__version__, "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
