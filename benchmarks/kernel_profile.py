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
CUDA events beside the kernel sum (the gap is launch and host time; with
--layers L, a residual stack's step, where that gap is the GPU left idle).
A name launched several times a step gets each launch's time too. Names
are shortened to their first --width characters; `--json` writes the full
rows. moeforge launches its kernels early (each waits for the one before
it on the GPU), so a kernel's recorded time includes that wait: run with
MOEFORGE_NO_EARLY_LAUNCH=1 for each kernel's own time.

usage: python3 benchmarks/kernel_profile.py [--shape fine64] [--impls moeforge,sonicmoe,torch]
       [--layers 1] [--steps 5] [--width 70] [--json out.json]
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


def profile(impl, shape, steps, steady, layers):
    T, d, f, E, k = stack.SHAPES[shape]
    dev = torch.device("cuda")
    model = torch.nn.ModuleList(stack.make_layer(impl, 100 + i, (T, d, f, E, k), dev, "auto")
                                for i in range(layers))
    g = torch.Generator(device=dev).manual_seed(7)
    x = ((torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()).requires_grad_()
    dy = (torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()

    def step():
        # One layer: y = layer(x); more: torch_stack_train.py's residual stack.
        model.zero_grad(set_to_none=True)
        x.grad = None
        h = x
        for layer in model:
            h = layer(h).to(dy.dtype) if layers == 1 else h + layer(h).to(h.dtype)
        h.backward(dy)

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
    kernels = collections.defaultdict(list)  # name -> each launch's us, in order
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name and "Memset" not in e.name:
            kernels[e.name].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    rows = []
    for n, us in kernels.items():
        # A name launched several times a step (a peer's one GEMM kernel for
        # several GEMMs): each launch of a step apart, by its place in it.
        per = len(us) // steps if len(us) % steps == 0 else 0
        launches = [sum(us[i::per]) / 1000 / steps for i in range(per)] if per > 1 else []
        rows.append({"kernel": n, "ms_per_step": sum(us) / 1000 / steps, "launches_per_step": len(us) / steps,
                     "ms_per_launch": launches})
    rows.sort(key=lambda r: -r["ms_per_step"])
    del model, x, dy
    torch.cuda.empty_cache()
    return {"impl": stack.impl_label(impl), "shape": shape, "layers": layers,
            "wall_ms": sorted(wall)[len(wall) // 2], "kernels": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="fine64")
    ap.add_argument("--impls", default="moeforge,sonicmoe,torch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--steady", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=70)
    ap.add_argument("--layers", type=int, default=1, help="a residual stack of this many layers (1: the layer alone)")
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
        r = profile(impl, a.shape, a.steps, a.steady, a.layers)
        out.append(r)
        total = sum(k["ms_per_step"] for k in r["kernels"])
        print(f"\n{r['impl']} {a.shape} L={a.layers}: step {r['wall_ms']:.2f} ms (events, median), kernels {total:.2f} ms "
              f"in {sum(k['launches_per_step'] for k in r['kernels']):.0f} launches")
        for k in r["kernels"]:
            if k["ms_per_step"] < 0.005:
                continue
            each = " (" + " / ".join(f"{t:.3f}" for t in k["ms_per_launch"]) + ")" if k["ms_per_launch"] and \
                len(k["ms_per_launch"]) <= 6 else ""
            print(f"  {k['ms_per_step']:8.3f} ms {100 * k['ms_per_step'] / total:5.1f} % "
                  f"x{k['launches_per_step']:<4.0f} {k['kernel'][:a.width]}{each}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                       "torch": torch.__version__, "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
