#!/usr/bin/env python3
"""What is alive at a stack's memory peak: torch_stack_train.py's residual
stack of L layers (one implementation, one shape, grads set to None), one
training step recorded by torch's allocator history; the allocations live
at the step's peak of allocated bytes, largest first, each with its size
and the Python frames that made it (grouped by those frames).

usage: python3 benchmarks/stack_memory_probe.py [--impl moeforge] [--shape fine64] [--layers 8] [--top 25]
       [--blocks MiB] [--dump FILE.json.gz]
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


def new_segments(before, trace):
    """Why the pool grew: replays the step's events over the segments and
    blocks the pool held before it, and for every segment the allocator
    had to add, returns (request bytes, frames, cached free bytes then,
    largest free block then): a new segment while more than the request
    lay free is fragmentation."""
    segments = {s["address"]: s["total_size"] for s in before}
    live = {b["address"]: b["size"] for s in before for b in s["blocks"] if b["state"] == "active_allocated"}
    out, pending = [], None

    def free_blocks():
        gaps = []
        for base, size in segments.items():
            at = base
            for addr in sorted(a for a in live if base <= a < base + size):
                gaps.append(addr - at)
                at = addr + live[addr]
            gaps.append(base + size - at)
        return gaps

    for e in trace:
        act = e["action"]
        if act == "segment_alloc":
            gaps = free_blocks()
            pending = (sum(gaps), max(gaps, default=0))
            segments[e["addr"]] = e["size"]
        elif act == "segment_free":
            segments.pop(e["addr"], None)
        elif act == "alloc":
            live[e["addr"]] = e["size"]
            if pending is not None:
                out.append((e["size"], frames_of(e, depth=3), *pending))
                pending = None
        elif act == "free_completed":
            live.pop(e["addr"], None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="moeforge")
    ap.add_argument("--shape", default="fine64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--blocks", type=float, default=0, help="also list each live block of at least this many MiB")
    ap.add_argument("--dump", help="also write the pool before the step and the step's events here (.json.gz), "
                                   "to replay the allocator offline")
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
    # As torch_stack_train.py times it: from a pool emptied of free blocks.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory._snapshot()["segments"]
    reserved0 = torch.cuda.memory_reserved()
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
    if a.dump:
        import gzip
        import json
        events = [{"action": e["action"], "addr": e["addr"], "size": e["size"], "where": frames_of(e, depth=3)}
                  for e in trace]
        with gzip.open(a.dump, "wt") as fh:
            json.dump({"before": before, "events": events}, fh)
    grown = new_segments(before, trace)
    print(f"reserved {reserved0 / MiB:.0f} MiB before the step, {torch.cuda.max_memory_reserved() / MiB:.0f} at its "
          f"end; {len(grown)} segments added (request MiB / free cached then / largest free block, by whom):")
    for size, where, free, largest in grown:
        flag = "  fragmented" if free >= size else ""
        print(f"  {size / MiB:8.1f} / {free / MiB:8.1f} / {largest / MiB:8.1f}  {where}{flag}")
    sizes = collections.Counter(round(e["size"] / MiB, 1) for e in at_peak.values())
    print("blocks by size (MiB x count):", ", ".join(f"{s} x {n}" for s, n in sorted(sizes.items(), reverse=True)))


if __name__ == "__main__":
    main()
