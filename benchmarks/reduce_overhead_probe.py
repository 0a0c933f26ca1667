#!/usr/bin/env python3
"""Why torch.compile(mode="reduce-overhead") refuses a model holding a
moeforge layer: runs tests/python/test_torch_compile.py's block (x +
moe(norm(x))) compiled that way for a few training steps with the
allocator's history recorded. Where inductor's CUDA-graph trees raise
"These storage data ptrs are not allocated in pool ...", each pointer it
names is looked up in the history: the allocation's size, the pool its
segment belongs to, and the Python frames that made it (which of the
module's tensors it is). Prints "no error" where the steps run.

With --dynamic the block is compiled with dynamic=True (the token count
symbolic): where the forward op's fake kernel sized the saved region with
new_dynamic_size() (an unbacked size), inductor split the graph around the
op and its CUDA-graph trees raised as above; it now evaluates the layer's
saved_terms() at the symbolic count.

usage: python3 benchmarks/reduce_overhead_probe.py [--steps 4] [--compiled-only] [--dynamic]
"""
import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from test_torch_compile import Block, step  # noqa: E402


def frames(entry, depth=6):
    out = [f"{os.path.basename(f.get('filename', ''))}:{f.get('line')} {f.get('name')}"
           for f in entry.get("frames", []) if f.get("filename", "").endswith(".py")]
    return " < ".join(out[:depth]) or "(no Python frame)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compiled-only", action="store_true", help="no eager step before the compiled ones")
    ap.add_argument("--dynamic", action="store_true", help="compile with dynamic=True (a symbolic token count)")
    a = ap.parse_args()
    torch.manual_seed(5)
    model = Block("cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=True if a.dynamic else None)
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        # The test's order: one eager step first (the module's runtime made
        # outside any graph), then the compiled steps, each output cloned.
        if not a.compiled_only:
            step(model, x, dy)
        for i in range(a.steps):
            [t.clone() for t in step(compiled, x, dy)]
            torch.cuda.synchronize()
            print(f"step {i}: ran")
        print("no error")
        return
    except RuntimeError as e:
        message = str(e)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print("error:", message[:600])
    ptrs = {int(p) for p in re.findall(r"\b(\d{9,})\b", message.split("but should be")[-1])}
    print("pointers named:", sorted(ptrs))
    pools = {}
    for seg in snap["segments"]:
        addr = seg["address"]
        for block in seg["blocks"]:
            pools[addr] = (seg.get("segment_pool_id"), block["size"], block["state"])
            addr += block["size"]
    for trace in snap["device_traces"]:
        for entry in trace:
            if entry["action"] == "alloc" and entry["addr"] in ptrs:
                pool = pools.get(entry["addr"])
                print(f"  {entry['addr']}: {entry['size']} bytes, now {pool}, made at {frames(entry)}")


if __name__ == "__main__":
    main()
