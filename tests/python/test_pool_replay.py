"""benchmarks/pool_replay.py: its model of torch's caching allocator takes
the best-fitting free block, splits it at its start when more than 1 MiB is
left, merges a freed block with free neighbours, and adds a segment only
when no free block fits; the recorded step of the s53 probe replays to the
peak reserved the device reported."""

import gzip
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import pool_replay  # noqa: E402

MiB = 1 << 20


def replay(events, resize=()):
    addr = iter(range(1, 1000))
    names, out = {}, []
    for act, name, size in events:
        if act == "alloc":
            names[name] = next(addr)
        out.append({"action": "alloc" if act == "alloc" else "free_completed", "addr": names[name],
                    "size": int(size * MiB)})
    return pool_replay.replay({"before": [], "events": out}, list(resize))


def test_a_freed_block_is_split_for_a_smaller_request_and_merged_back():
    pool = replay([("alloc", "a", 100), ("free", "a", 100), ("alloc", "b", 60), ("alloc", "c", 40),
                   ("free", "b", 60), ("free", "c", 40), ("alloc", "d", 100)])
    assert pool.peak_reserved == 100 * MiB  # b and c split a's segment; d reuses it whole
    assert pool.peak_allocated == 100 * MiB


def test_no_fitting_block_adds_a_segment_though_more_lies_free():
    # Two 50 MiB holes, 100 MiB free in all, but not one block of 60.
    pool = replay([("alloc", "a", 50), ("alloc", "b", 50), ("alloc", "c", 50), ("free", "a", 50),
                   ("free", "c", 50), ("alloc", "d", 60)])
    assert pool.peak_reserved == 210 * MiB
    assert pool.peak_allocated == 150 * MiB  # a, b and c before the frees


def test_best_fit_keeps_the_large_block_whole():
    pool = replay([("alloc", "big", 200), ("alloc", "small", 64), ("free", "big", 200), ("free", "small", 64),
                   ("alloc", "x", 60), ("alloc", "y", 200)])
    assert pool.peak_reserved == 264 * MiB  # x took the 64 MiB block, y the 200 one


def test_resizing_a_request_changes_the_replay():
    events = [("alloc", "a", 100), ("free", "a", 100), ("alloc", "b", 120)]
    assert replay(events).peak_reserved == 220 * MiB
    assert replay(events, [(120.0, [100.0])]).peak_reserved == 100 * MiB


def test_a_request_split_in_parts_fits_blocks_the_whole_does_not():
    # Two 60 MiB holes: a 120 MiB request needs a segment of its own; made
    # as two requests of 60, it takes the holes, and both go when it is freed.
    events = [("alloc", "a", 60), ("alloc", "b", 60), ("free", "a", 60), ("free", "b", 60),
              ("alloc", "c", 120), ("free", "c", 120), ("alloc", "d", 60)]
    assert replay(events).peak_reserved == 240 * MiB
    parts = replay(events, [(120.0, [60.0, 60.0])])
    assert parts.peak_reserved == 120 * MiB and parts.allocated == 60 * MiB


def test_the_recorded_step_replays_to_the_devices_peak():
    trace = ROOT / "benchmarks/results/2026-12-06-h100-s53/probe/trace_moeforge_fine64.json.gz"
    with gzip.open(trace, "rt") as fh:
        pool = pool_replay.replay(json.load(fh), [])
    assert pool.peak_reserved == 19646 * MiB  # the probe's "19646 at its end"


def test_a_step_replayed_to_its_own_steady_pool():
    trace = ROOT / "benchmarks/results/2026-12-06-h100-s53/probe/trace_moeforge_fine64.json.gz"
    with gzip.open(trace, "rt") as fh:
        doc = json.load(fh)
    # The device's steps were already steady: more replays land where it did.
    assert pool_replay.replay(doc, [], steps=4).peak_reserved == 19646 * MiB
    # A resize judged from its own history differs from one judged from the
    # recorded pool (the forward's workspace, 918.5 MiB, made smaller).
    assert pool_replay.replay(doc, [(918.5, [544.5])], steps=4).peak_reserved != 19646 * MiB
