#!/usr/bin/env python3
"""Issue #17's comparison: what `moeforge tune` found against the
hand-written schedules, timed in one benchmark process over several rounds
(scripts/device_check.sh's tune stage).

Reads bench_moe_forward's and bench_moe_train's JSON (either may be missing)
and prints, per shape and routing, the median over rounds of each schedule
and tuned / best hand-written (below 1: the tuned one is faster)."""
import json
import os
import re
import statistics
import sys

FORWARD = re.compile(r"^forward/(\w+)/(.+)/(uniform|skewed)(?:/round\d+)?$")
TRAIN = re.compile(r"^train/(\w+)/(uniform|skewed)/(.+)/(store|lean|recompute)(?:/round\d+)?$")


def load(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [b for b in json.load(f)["benchmarks"] if not b.get("error_occurred")]


def name_of(schedule):
    return os.path.basename(schedule)


def collect(benchmarks, pattern, key):
    """(shape, routing) -> schedule -> list of (ms, roof ratio)."""
    out = {}
    for b in benchmarks:
        # Google Benchmark appends the run's options ("/iterations:3/manual_time").
        m = pattern.match(re.sub(r"/(iterations|manual_time|real_time).*$", "", b["run_name"]))
        if not m:
            continue
        shape, routing, schedule = key(m)
        out.setdefault((shape, routing), {}).setdefault(name_of(schedule), []).append(
            (b["real_time"], b.get("ratio", float("nan")), b.get("ratio_paired", float("nan"))))
        # The same case at the card's steady state, where the run timed it
        # (MOEFORGE_BENCH_STEADY_S: dense_roof.h's time_ms_steady).
        if "steady_ms" in b:
            out.setdefault((shape, routing, "steady"), {}).setdefault(name_of(schedule), []).append(
                (b["steady_ms"], b["ratio_steady"], float("nan")))
    return out


def report(title, cases, is_tuned, is_hand_written):
    if not cases:
        return
    # The roof ratio against the roof timed once per process, then (where the
    # benchmark times one after each case: dense_roof.h) the paired one. Rows
    # marked "steady state": both timed after seconds of their own work, at
    # the clock the power limit keeps (the second ratio is then n/a).
    print(f"## {title}: medians over rounds, ms (roof ratio / paired roof ratio)")
    print("| shape | routing | tuned | best hand-written | tuned / best | others |")
    print("|---|---|---|---|---|---|")
    for key, by_schedule in sorted(cases.items()):
        shape, routing = key[0], key[1] + (" (steady state)" if len(key) > 2 else "")
        med = {s: (statistics.median(t for t, _, _ in v), statistics.median(r for _, r, _ in v), len(v),
                   statistics.median(p for _, _, p in v))
               for s, v in by_schedule.items()}
        tuned = [s for s in med if is_tuned(s)]
        hand = [s for s in med if is_hand_written(s)]
        if not tuned or not hand:
            continue
        t = tuned[0]
        h = min(hand, key=lambda s: med[s][0])
        others = ", ".join(f"{s} {med[s][0]:.3f}" for s in sorted(med) if s not in (t, h))
        print(f"| {shape} | {routing} | {med[t][0]:.3f} ({med[t][1]:.3f} / {med[t][3]:.3f}, {med[t][2]} rounds) | "
              f"{med[h][0]:.3f} {h} ({med[h][1]:.3f} / {med[h][3]:.3f}) | **{med[t][0] / med[h][0]:.3f}** | "
              f"{others} |")
    print()


def main(argv):
    forward = collect(load(argv[1]) if len(argv) > 1 else [], FORWARD, lambda m: (m[1], m[3], m[2]))
    train = collect(load(argv[2]) if len(argv) > 2 else [], TRAIN,
                    lambda m: (m[1], m[2], m[3] + ("" if m[4] == "store" else "/" + m[4])))
    report("forward", forward, lambda s: s.endswith("_tuned.sched"), lambda s: s.startswith("tuned_tma"))
    report("training step (store)", train, lambda s: s.endswith("_tuned.sched"), lambda s: s == "tuned_wide")


if __name__ == "__main__":
    main(sys.argv)
