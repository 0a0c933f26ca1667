#!/usr/bin/env python3
"""Replays a training step's allocations through a model of torch's CUDA
caching allocator (its default settings: best fit, blocks split at their
start when more than 1 MiB is left, free neighbours merged, segments of
2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, else the request
rounded up to 2 MiB), to see which sizes and orders fragment the pool
without a GPU. The input is what `stack_memory_probe.py --dump` wrote: the
pool's segments before the step and the step's alloc / free events.

It prints the peak reserved and allocated bytes the model reaches, to
check the model against the device's figures, and with --resize
OLD:NEW[,...] (MiB, matched to 0.1) the same step with those requests'
sizes changed, to try a layout before building it (NEW as A+B+...: the
request made as that many allocations, held and freed together); --steps N replays the
step N times (the cache emptied before the last, as the device's timed
step), so that the pool the last one starts from is the resized layout's
own, not the recorded history's.

usage: python3 benchmarks/pool_replay.py TRACE.json.gz [--resize 754.1:704,896.6:448+448+0.6] [--steps 4]
"""
import argparse
import bisect
import gzip
import json

MiB = float(1 << 20)
SMALL = 1 << 20          # requests up to this go to the small pool
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20


def round_size(n):
    return max(512, (n + 511) // 512 * 512)


def segment_size(n):
    if n <= SMALL:
        return 2 << 20
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (n + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


class Pool:
    """One stream's blocks, both pools, as torch's allocator keeps them."""

    def __init__(self):
        self.free = {True: [], False: []}  # small? -> sorted [(size, addr)]
        self.blocks = {}  # addr -> [size, allocated, segment base, small]
        self.segments = {}  # base -> size
        self.next_addr = 1 << 40
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0

    def _add_free(self, addr):
        size, _, _, small = self.blocks[addr]
        bisect.insort(self.free[small], (size, addr))

    def _drop_free(self, addr):
        size, _, _, small = self.blocks[addr]
        self.free[small].remove((size, addr))

    def add_segment(self, size, small, base=None):
        base = self.next_addr if base is None else base
        self.next_addr = max(self.next_addr, base + size + (1 << 30))
        self.segments[base] = size
        self.blocks[base] = [size, False, base, small]
        self._add_free(base)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return base

    def malloc(self, request):
        size = round_size(request)
        small = size <= SMALL
        pool = self.free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            addr = self.add_segment(segment_size(size), small)
        else:
            addr = pool[i][1]
        self._drop_free(addr)
        block = self.blocks[addr]
        left = block[0] - size
        if (small and left >= 512) or (not small and left > SMALL):
            block[0] = size
            self.blocks[addr + size] = [left, False, block[2], small]
            self._add_free(addr + size)
        block[1] = True
        self.allocated += block[0]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return addr

    def release(self, addr):
        block = self.blocks[addr]
        block[1] = False
        self.allocated -= block[0]
        base = block[2]
        # merge with the next and the previous free block of the segment
        nxt = addr + block[0]
        if nxt in self.blocks and not self.blocks[nxt][1] and self.blocks[nxt][2] == base:
            self._drop_free(nxt)
            block[0] += self.blocks.pop(nxt)[0]
        prev = next((a for a, b in self.blocks.items() if a + b[0] == addr and b[2] == base and not b[1]), None)
        if prev is not None:
            self._drop_free(prev)
            self.blocks[prev][0] += self.blocks.pop(addr)[0]
            addr = prev
        self._add_free(addr)


def empty_cache(pool):
    """torch.cuda.empty_cache(): every wholly free segment goes back."""
    for base, size in list(pool.segments.items()):
        block = pool.blocks.get(base)
        if block is not None and not block[1] and block[0] == size:
            pool._drop_free(base)
            del pool.blocks[base], pool.segments[base]
            pool.reserved -= size


def replay(doc, resize, steps=1):
    pool = Pool()
    # The pool before the step: its segments and the blocks in them.
    for seg in sorted(doc["before"], key=lambda s: s["address"]):
        small = seg.get("segment_type") == "small"
        base = pool.add_segment(seg["total_size"], small, seg["address"])
        pool._drop_free(base)
        del pool.blocks[base]
        for b in seg["blocks"]:
            used = b["state"] == "active_allocated"
            pool.blocks[b["address"]] = [b["size"], used, base, small]
            if used:
                pool.allocated += b["size"]
            else:
                pool._add_free(b["address"])
    pool.peak_allocated = pool.allocated
    pool.peak_reserved = pool.reserved
    # Blocks from before the step that it frees (the last step's weight
    # gradients, dropped by zero_grad): in a later replayed step, the
    # blocks the step before it left allocated stand for them, in order.
    carried = [e["addr"] for e in doc["events"] if e["action"] == "free_completed"
               and e["addr"] in pool.blocks and pool.blocks[e["addr"]][1]]
    stand_in = {a: [a] for a in carried}
    for step in range(steps):
        if step == steps - 1 and steps > 1:
            # The device's protocol: the cache emptied before the timed step.
            empty_cache(pool)
            pool.peak_allocated, pool.peak_reserved = pool.allocated, pool.reserved
        ours = {}  # the trace's address -> the model's
        for e in doc["events"]:
            if e["action"] == "alloc":
                sizes = [e["size"]]
                for old, new in resize:
                    if abs(e["size"] / MiB - old) < 0.05:
                        sizes = [int(part * MiB) for part in new]
                ours[e["addr"]] = [pool.malloc(n) for n in sizes]
            elif e["action"] == "free_completed":
                if e["addr"] in ours:
                    for block in ours.pop(e["addr"]):
                        pool.release(block)
                elif e["addr"] in stand_in:  # blocks from before the step
                    for block in stand_in.pop(e["addr"]):
                        pool.release(block)
        # What this step leaves allocated stands for what it freed from before
        # (every block of a request made in parts).
        stand_in = dict(zip(carried, ours.values()))
    return pool


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--resize", default="", help="OLD:NEW MiB pairs, comma-separated")
    ap.add_argument("--steps", type=int, default=1,
                    help="replay the step this many times, the cache emptied before the last (a resized layout's "
                         "own steady state; 1: the recorded pool as it was)")
    a = ap.parse_args()
    with gzip.open(a.trace, "rt") as fh:
        doc = json.load(fh)
    resize = [(float(old), [float(part) for part in new.split("+")])
              for old, new in (pair.split(":") for pair in a.resize.split(",") if pair)]
    pool = replay(doc, resize, a.steps)
    print(f"{a.trace}: peak reserved {pool.peak_reserved / MiB:.0f} MiB, peak allocated "
          f"{pool.peak_allocated / MiB:.0f} MiB, reserved over allocated {(pool.peak_reserved - pool.peak_allocated) / MiB:.0f}"
          + (f" (resized {a.resize})" if resize else ""))


if __name__ == "__main__":
    main()
