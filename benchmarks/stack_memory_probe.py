#!/usr/bin/env python3
"""What is alive at a stack's memory peak: torch_stack_train.py's residual
stack of L layers (one implementation, one shape, grads set to None), one
training step recorded by torch's allocator history; the allocations live
at the step's peak of allocated bytes, largest first, each with its size
and the Python frames that made it (grouped by those frames).

usage: python3 benchmarks/stack_memory_probe.py [--impl moeforge] [--shape fine64] [--layers 8] [--top 25]
       [--blocks MiB]
"""
import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_stack_train as stack  # noqa: E402

MiB = float(1 << 20)


def frames_of(entry, depth=4):
    """The allocation's innermost Python frames outside torch, as text."""
    out = []
    for f in entry.get("frames", []):
        name = f.get("filename", "")
        if "site-packages/torch/" in name or not name.endswith(".py"):
            continue
        out.append(f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}")
        if len(out) == depth:
            break
    return " < ".join(out) or "(no Python frame)"


def live_at_peak(trace):
    """Replays one device's alloc / free events: the blocks live when the
    allocated bytes were highest, that peak, and the allocation that
    reached it (where in the step the peak is)."""
    live, total, peak, at_peak, last = {}, 0, 0, {}, None
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak, last = total, dict(live), e
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return at_peak, peak, last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="moeforge")
    ap.add_argument("--shape", default="fine64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--blocks", type=float, default=0, help="also list each live block of at least this many MiB")
    a = ap.parse_args()
    T, d, f, E, k = stack.SHAPES[a.shape]
    dev = torch.device("cuda")
    model = torch.nn.ModuleList(stack.make_layer(a.impl, 100 + i, (T, d, f, E, k), dev, "auto")
                                for i in range(a.layers))
    g = torch.Generator(device=dev).manual_seed(7)
    x = (torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()
    dy = (torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()

    def step():
        model.zero_grad(set_to_none=True)
        h = x
        for layer in model:
            h = h + layer(h).to(h.dtype)
        h.backward(dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][dev.index or 0]
    # Blocks allocated before the recording (weights, x, dy) are live
    # throughout: their bytes are `base`, less the grads zero_grad frees.
    at_peak, peak, last = live_at_peak(trace)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{a.impl} {a.shape} L={a.layers}: allocated before the step {base / MiB:.0f} MiB "
          f"(weights {weights / MiB:.0f}); at the step's peak {peak / MiB:.0f} MiB more, in {len(at_peak)} blocks")
    groups = collections.defaultdict(lambda: [0, 0])
    for e in at_peak.values():
        key = frames_of(e)
        groups[key][0] += e["size"]
        groups[key][1] += 1
    for key, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"{size / MiB:9.1f} MiB {n:4d} x  {key}")
    if last is not None:
        print(f"the peak reached by {last['size'] / MiB:.1f} MiB made at {frames_of(last, depth=8)}")
    if a.blocks:  # each large block on its own, with more of its frames
        for e in sorted(at_peak.values(), key=lambda e: -e["size"]):
            if e["size"] >= a.blocks * MiB:
                print(f"  {e['size'] / MiB:9.1f} MiB  {frames_of(e, depth=8)}")
    sizes = collections.Counter(round(e["size"] / MiB, 1) for e in at_peak.values())
    print("blocks by size (MiB x count):", ", ".join(f"{s} x {n}" for s, n in sorted(sizes.items(), reverse=True)))


if __name__ == "__main__":
    main()
