#!/usr/bin/env python3
"""A model's training step, not a layer's: a residual stack of L MoE layers
(h = h + layer(h), the L forwards, then the L backwards from one loss), for
moeforge.torch, a torch._grouped_mm layer (benchmarks/torch_grouped_mm_train.py's)
and SonicMoE where it is installed, on the same weights and inputs.

Per implementation, shape and L: the step's median ms (CUDA events, after a
pause and a warm-up of its own, the median of --reps steps), and the device
memory at the step's peak, counted at the device level: torch's peak
reserved bytes plus what the implementation holds outside torch's caching
allocator (the change of cudaMemGetInfo's used bytes less torch's reserved
change, taken after the step), and that outside part alone. The weights and
their gradients are in every figure (the same for all three). By default
the timed steps start from a pool emptied of its free blocks (what the
warm-up's steps and compiles left cached is reported beside, not counted):
torch's peak reserved for the same allocations otherwise moved by up to a
GiB from run to run with what the pool held before.

Every layer's weights are drawn from its own seed on the GPU, so the three
implementations get identical values without a host copy: W1, W3 [E, d, f],
W2 [E, f, d] U(-1, 1) / sqrt(fan-in), the router [d, E] likewise; x U(-1, 1).
--routing skewed tilts every router by the other benchmarks' logit ramp (see
layer_weights; the first layer's max / mean load is reported). --rounds N
runs every row N times, the implementations alternating; the table gives
the median step and the highest peak over the rounds, each step over the
same implementation's one-layer step ("x L=1", with --layers 1,...) and
over SonicMoE's ("/ sonic"). L = 1 is issue 50's one-layer comparison.
Every row runs in a process of its own (--isolate 0: all in this one), so
its peak counts from an empty pool: in one process a row's model found the
blocks earlier rows left in segments torch could not release, and its
reserved peak read under its own allocated peak.
The JSON names the device, the date, the commit (git's, or MOEFORGE_COMMIT
on a machine given the files alone) and torch's allocator settings.

usage: python3 benchmarks/torch_stack_train.py [--shapes qwen3moe,fine64]
       [--layers 8,24] [--impls moeforge,moeforge:FILE,moeforge+CHOICE-CHOICE,torch,sonicmoe] [--schedule auto|PRESET|FILE]
       [--grads kept,none] [--routing uniform,skewed] [--rounds N] [--reps N] [--steady SECONDS]
       [--fresh-pool 1|0] [--out results.json]
"""
import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_grouped_mm_train as tgm  # noqa: E402

SHAPES = {name: (T, d, f, E, k) for name, T, d, f, E, k, swiglu, _ in tgm.SHAPES if swiglu}
# --routing skewed: the shape's router-logit ramp, as bench_moe_train and
# torch_grouped_mm_train.py skew it (benchmarks/moe_shapes.h: the busiest
# expert about 3x the mean).
SKEW_RAMP = {name: ramp for name, *_, swiglu, ramp in tgm.SHAPES if swiglu}
GiB = float(1 << 30)


def skew_direction(d, dev):
    """The unit vector along which --routing skewed tilts every router and
    shifts the input (one for the whole stack, from a fixed seed)."""
    g = torch.Generator(device=dev).manual_seed(11)
    u = torch.randn(d, device=dev, generator=g)
    return u / u.norm()


def layer_weights(seed, d, f, E, dev, ramp=0.0):
    """W1, W3 [E, d, f], W2 [E, f, d], wr [d, E] in bf16, from `seed`.
    A ramp (--routing skewed) adds ramp * e / E along skew_direction to
    wr[:, e], so a row with a component c along it adds c times the other
    benchmarks' logit ramp to expert e's logit (the input carries c ~ 1, see
    run()). The routers here have no bias, which SonicMoE's and moeforge's
    layers would not take, so the ramp rides on the weights."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def u(*shape, fan_in):
        return (torch.rand(*shape, device=dev, generator=g) * 2 - 1) / fan_in ** 0.5

    w1, w3, w2, wr = u(E, d, f, fan_in=d), u(E, d, f, fan_in=d), u(E, f, d, fan_in=f), u(d, E, fan_in=d)
    if ramp:
        tilt = ramp * torch.arange(E, device=dev, dtype=torch.float32) / E
        wr = wr + skew_direction(d, dev)[:, None] * tilt[None, :]
    return tuple(w.bfloat16() for w in (w1, w3, w2, wr))


class TorchLayer(torch.nn.Module):
    """torch_grouped_mm_train.py's layer: weights stored [E, N, K] as nn.Linear's."""

    def __init__(self, w1, w3, w2, wr, k):
        super().__init__()
        self.w1 = torch.nn.Parameter(w1.transpose(1, 2).contiguous())
        self.w3 = torch.nn.Parameter(w3.transpose(1, 2).contiguous())
        self.w2 = torch.nn.Parameter(w2.transpose(1, 2).contiguous())
        self.wr = torch.nn.Parameter(wr.clone())
        self.k = k
        self.register_buffer("bias", torch.zeros(wr.shape[1], device=wr.device))
        self.mm = tgm.make_mm("native" if tgm.native_backward_works(wr.device)[0] else "manual")

    def forward(self, x):
        t = lambda w: w.transpose(-2, -1)
        return tgm.forward(x, self.wr, self.bias, t(self.w1), t(self.w3), t(self.w2), self.k, True, self.mm)


def moeforge_layer(w1, w3, w2, wr, k, schedule):
    import moeforge as mf
    import moeforge.torch as mft
    E, d, f = w1.shape
    m = mft.example("swiglu_moe", experts=E, topk=k, d=d, f=f, schedule=schedule)
    with torch.no_grad():
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2), ("wr", wr)):
            getattr(m, name).copy_(w)
    return m


class SonicLayer(torch.nn.Module):
    def __init__(self, w1, w3, w2, wr, k):
        super().__init__()
        from sonicmoe.enums import ActivationType, KernelBackendMoE
        from sonicmoe.moe import MoE
        E, d, f = w1.shape
        self.backend = KernelBackendMoE.sonicmoe
        self.m = MoE(E, k, d, f, ActivationType.SWIGLU, add_bias=False, std=0.02).to(wr.device).bfloat16()
        with torch.no_grad():
            self.m.router.weight.copy_(wr.t())
            self.m.c_fc.weight[:, 0::2, :].copy_(w1.transpose(1, 2))
            self.m.c_fc.weight[:, 1::2, :].copy_(w3.transpose(1, 2))
            self.m.c_proj.weight.copy_(w2.transpose(1, 2))

    def forward(self, x):
        return self.m(x, kernel_backend_moe=self.backend)[0]


def make_layer(impl, seed, shape, dev, schedule, ramp=0.0):
    T, d, f, E, k = shape
    w = layer_weights(seed, d, f, E, dev, ramp)
    if impl.startswith("moeforge"):
        return moeforge_layer(*w, k, impl_schedule(impl, schedule, shape))
    if impl == "torch":
        return TorchLayer(*w, k)
    return SonicLayer(*w, k)


def impl_schedule(impl, schedule, shape):
    """moeforge:FILE runs the schedule in FILE; moeforge+CHOICE / -CHOICE...
    (e.g. moeforge+atomic_combine+gather_in_gemms,
    moeforge-split_pointwise_for_memory) the layer's default schedule with
    those layer-wide choices on (+) or off (-), made for each shape; plain
    moeforge, --schedule's."""
    import re
    import moeforge as mf
    if ":" not in impl and re.search(r"[+-]", impl):
        _, d, f, E, k = shape
        ex, _ = mf.make_example("swiglu_moe", tokens=1, experts=E, topk=k, d=d, f=f)
        s = mf.default_schedule(ex.pipeline, list(ex.pipeline.outputs))
        for sign, choice in re.findall(r"([+-])([A-Za-z0-9_]+)", impl):
            if not hasattr(s, choice):
                raise SystemExit(f"--impls {impl}: the schedule has no choice '{choice}'")
            getattr(s, choice)(sign == "+")
        return s
    if ":" not in impl:
        return schedule
    return mf.Schedule.load(impl.split(":", 1)[1])


def impl_label(impl):
    """moeforge:benchmarks/schedules/train/x.sched prints as moeforge:x."""
    if ":" not in impl:
        return impl
    return "moeforge:" + os.path.splitext(os.path.basename(impl.split(":", 1)[1]))[0]


def graph_counts(model):
    """moeforge's layers: how their entry points' calls ran (replayed from a
    CUDA graph, captured, eager), summed; {} for the other implementations."""
    total = {}
    for layer in model:
        runtime = getattr(layer, "_caller", None)
        if runtime is not None:
            for key, n in runtime.layer.graph_counts().items():
                total[key] = total.get(key, 0) + n
    return total


def used_outside(free0, reserved0):
    free, _ = torch.cuda.mem_get_info()
    return (free0 - free) - (torch.cuda.memory_reserved() - reserved0)


def sm_clock_mhz():
    """The SM clock now (NVML, through torch), or None where it cannot be read."""
    try:
        return torch.cuda.clock_rate()
    except Exception:  # no pynvml on this machine: the row goes without it
        return None


def expert_loads(model, x, k):
    """The first layer's tokens per expert on x (its router's top-k of the
    f32 logits), as max / mean: how skewed the timed routing is."""
    wr = getattr(model[0], "wr", None)
    if wr is None:  # SonicLayer: the router is nn.Linear [E, d]
        wr = model[0].m.router.weight.t()
    top = (x.float() @ wr.float()).topk(k, dim=1).indices
    counts = torch.bincount(top.flatten(), minlength=wr.shape[1]).float()
    return (counts.max() / counts.mean()).item()


def run(impl, name, layers, reps, schedule, pause, grads, steady, fresh_pool, routing="uniform"):
    T, d, f, E, k = SHAPES[name]
    dev = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    reserved0 = torch.cuda.memory_reserved()
    allocated0 = torch.cuda.memory_allocated()
    model = torch.nn.ModuleList(
        make_layer(impl, 100 + i, (T, d, f, E, k), dev, schedule, SKEW_RAMP[name] if routing == "skewed" else 0.0)
        for i in range(layers))
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.rand(T, d, device=dev, generator=g) * 2 - 1
    if routing == "skewed":  # every row one unit along the routers' tilt
        x = x + skew_direction(d, dev)[None, :]
    x = x.bfloat16()
    dy = (torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()

    def step():
        # "kept": the gradients stay allocated and each backward adds into
        # them (gradient accumulation's later micro-batches); "none":
        # torch's default zero_grad, each backward's gradient tensors become
        # .grad (the first micro-batch of a step).
        model.zero_grad(set_to_none=(grads == "none"))
        h = x
        for layer in model:
            h = h + layer(h).to(h.dtype)
        h.backward(dy)

    t0 = time.time()
    step()  # compiles (SonicMoE: 10-90 s at a new shape)
    torch.cuda.synchronize()
    first_s = time.time() - t0
    print(f"  {impl_label(impl)} {name} L={layers}: first step {first_s:.1f} s", file=sys.stderr, flush=True)
    step()
    torch.cuda.synchronize()
    time.sleep(pause)
    for _ in range(2):
        step()
    # --steady: the timed steps come after that many seconds of this
    # implementation's own steps, at the card's power limit as a training
    # run is (a few steps after a pause run at the burst clock, which
    # flatters a short step more than a long one).
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < steady:
        step()
        torch.cuda.synchronize()
    # Reserved as the warm-up left it (its first step's compiles included),
    # then from a pool emptied of every free block: the timed steps' peak
    # then shows what this implementation's own step reserves (its
    # allocations and the fragmentation they make), not what the pool
    # happened to hold from earlier steps. Both are reported.
    torch.cuda.synchronize()
    warm_reserved = torch.cuda.memory_reserved() - reserved0
    if fresh_pool:
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    graphs_before = graph_counts(model)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, clocks = [], []
    for _ in range(reps):
        a.record()
        step()
        b.record()
        clocks.append(sm_clock_mhz())  # read while the step's kernels run
        b.synchronize()
        times.append(a.elapsed_time(b))
    peak_reserved = torch.cuda.max_memory_reserved() - reserved0
    peak_allocated = torch.cuda.max_memory_allocated() - allocated0
    outside = used_outside(free0, reserved0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    graphs = {key: n - graphs_before.get(key, 0) for key, n in graph_counts(model).items()}
    row = {"impl": impl_label(impl), "shape": name, "layers": layers, "step_ms": statistics.median(times),
           "step_ms_min": min(times), "peak_GiB": (peak_reserved + outside) / GiB, "outside_GiB": outside / GiB,
           "peak_allocated_GiB": peak_allocated / GiB, "grads": grads, "fresh_pool": fresh_pool,
           "reserved_after_warmup_GiB": warm_reserved / GiB,
           "weights_and_grads_GiB": 2 * weights / GiB, "first_step_s": first_s, "routing": routing,
           "first_layer_max_over_mean_load": expert_loads(model, x, k)}
    if all(c is not None for c in clocks):
        row["sm_clock_MHz"] = statistics.median(clocks)
    if steady:
        row["steady_s"] = steady
    if graphs:  # the timed steps' entry-point calls: all replayed in a steady loop
        row["graphs_in_timed_steps"] = graphs
    del model, x, dy
    gc.collect()
    torch.cuda.empty_cache()
    return row


def error_row(job, error):
    """The row of a job that gave no figures, saying why."""
    return {"impl": impl_label(job["impl"]), "shape": job["name"], "layers": job["layers"], "grads": job["grads"],
            "routing": job["routing"], "error": error}


def run_row(job):
    """run() on a job's arguments; out of memory is a row with its error."""
    job = dict(job)
    if os.path.exists(job["schedule"]):
        import moeforge as mf
        job["schedule"] = mf.Schedule.load(job["schedule"])
    try:
        return run(**job)
    except torch.OutOfMemoryError as e:
        gc.collect()
        torch.cuda.empty_cache()
        return error_row(job, "out of memory: " + str(e)[:120])


ROW_TAG = "STACK_ROW "


def run_one_row(job):
    print(ROW_TAG + json.dumps(run_row(job)), flush=True)


def run_in_child(job):
    """The row in a fresh process (its CUDA context, torch's pool and
    moeforge's caches its own); its progress goes to our stderr. A child
    that dies leaves a row naming its exit status and last words."""
    import subprocess
    cmd = [sys.executable, os.path.abspath(__file__), "--one-row", json.dumps(job)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stderr)
    tagged = [line for line in proc.stdout.splitlines() if line.startswith(ROW_TAG)]
    if proc.returncode == 0 and tagged:
        return json.loads(tagged[-1][len(ROW_TAG):])
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-2:])
    return error_row(job, f"row process exited {proc.returncode}: {tail[:160]}")


def write_json(path, alloc_conf, commit, rows):
    if not path:
        return
    doc = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit,
           "torch": torch.__version__, "alloc_conf": alloc_conf, "rows": rows}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mixtral,fine64,qwen3moe,gptoss")
    ap.add_argument("--layers", default="8")
    ap.add_argument("--impls", default="moeforge,torch,sonicmoe")
    ap.add_argument("--schedule", default="auto", help="moeforge's: auto (the module's default), a preset or a file")
    ap.add_argument("--grads", default="kept",
                    help="comma-separated: kept: .grad stays allocated between steps (zero_grad(set_to_none=False)); "
                         "none: torch's default zero_grad")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pause", type=float, default=1.0)
    ap.add_argument("--steady", type=float, default=0.0,
                    help="seconds of each implementation's own steps before its timed ones (0: after --pause)")
    ap.add_argument("--fresh-pool", type=int, default=1,
                    help="1: empty torch's cache of free blocks before the timed steps, so their peak reserved is "
                         "their own (0: as the warm-up left the pool)")
    ap.add_argument("--routing", default="uniform",
                    help="comma-separated: uniform (random routers), skewed (every router tilted by the shape's "
                         "logit ramp, as bench_moe_train skews it; see layer_weights)")
    ap.add_argument("--rounds", type=int, default=1, help="times each row runs, the implementations alternating")
    ap.add_argument("--isolate", type=int, default=1,
                    help="1: every row in a process of its own, so its peak counts from an empty pool (in one "
                         "process a row's model finds the blocks earlier rows left in segments torch cannot "
                         "release, and its reserved peak reads low); 0: every row in this process")
    ap.add_argument("--one-row", help=argparse.SUPPRESS)  # a child of --isolate 1: run() on these JSON arguments
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.one_row:
        run_one_row(json.loads(args.one_row))
        return
    for r in args.routing.split(","):
        if r not in ("uniform", "skewed"):
            ap.error(f"--routing: '{r}' is neither 'uniform' nor 'skewed'")
    impls = args.impls.split(",")
    if "sonicmoe" in impls:
        try:
            import sonicmoe  # noqa: F401
        except ImportError as e:
            print(f"torch_stack_train: SonicMoE is not installed ({e}); skipping it", file=sys.stderr)
            impls.remove("sonicmoe")
    schedule = args.schedule or "auto"
    grads_modes = args.grads.split(",")
    for g in grads_modes:
        if g not in ("kept", "none"):
            ap.error(f"--grads: '{g}' is neither 'kept' nor 'none'")
    # torch's caching allocator as the environment set it up (torchtitan,
    # for one, trains with expandable_segments:True, which maps freed pages
    # into a segment that grows instead of cutting new segments, so the
    # pool's fragmentation, part of the reserved peak, differs).
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    print(f"torch allocator: {alloc_conf or 'default settings'}", flush=True)
    commit = source_commit()
    rows = []
    for name in args.shapes.split(","):
        for layers in [int(n) for n in args.layers.split(",")]:
            for routing in args.routing.split(","):
                # Rounds alternate the implementations (each after its own
                # pause and warm-up), so a drift of the card's clock over the
                # run reaches them all alike.
                for rnd in range(args.rounds):
                    for impl, grads in [(i, g) for g in grads_modes for i in impls]:
                        job = {"impl": impl, "name": name, "layers": layers, "reps": args.reps,
                               "schedule": schedule, "pause": args.pause, "grads": grads, "steady": args.steady,
                               "fresh_pool": args.fresh_pool, "routing": routing}
                        row = run_in_child(job) if args.isolate else run_row(job)
                        row["round"] = rnd
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        write_json(args.out, alloc_conf, commit, rows)  # after every row: a call cut short keeps what ran
    print_table(rows)


def aggregate(rows):
    """One row per (shape, L, routing, grads, impl): the median step over
    the rounds, the highest peak and allocated figures of any round."""
    groups = {}
    for r in rows:
        key = (r["shape"], r["layers"], r.get("routing", "uniform"), r["grads"], r["impl"])
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            out.append((key, {"error": rs[0]["error"]}))
            continue
        a = {"step_ms": statistics.median(r["step_ms"] for r in ok), "rounds": len(ok)}
        for f in ("peak_GiB", "outside_GiB", "peak_allocated_GiB", "reserved_after_warmup_GiB"):
            a[f] = max(r[f] for r in ok)
        clocks = [r["sm_clock_MHz"] for r in ok if "sm_clock_MHz" in r]
        if clocks:
            a["sm_clock_MHz"] = statistics.median(clocks)
        a["load"] = ok[0].get("first_layer_max_over_mean_load")
        out.append((key, a))
    return out


def print_table(rows):
    """The rows aggregated over rounds. "x L=1": the step over L times the
    same implementation's one-layer step in this run (what a stack adds
    beyond its layers); "/ sonic": the step over SonicMoE's for the same
    shape, L, routing and grads."""
    agg = aggregate(rows)
    by = {key: a for key, a in agg}
    print(f"\n{'shape':9} {'L':>3} {'routing':7} {'grads':5} {'impl':30} {'step ms':>8} {'x L=1':>6} {'/ sonic':>7} "
          f"{'peak GiB':>9} {'outside':>8} {'allocated':>9} {'warm res':>8} {'load':>5} {'MHz':>5}")
    for key, a in agg:
        shape, layers, routing, grads, impl = key
        head = f"{shape:9} {layers:>3} {routing:7} {grads:5} {impl:30}"
        if "error" in a:
            print(f"{head} {a['error'][:40]}")
            continue
        one = by.get((shape, 1, routing, grads, impl), {}).get("step_ms")
        over = f"{a['step_ms'] / (layers * one):6.3f}" if one else f"{'':6}"
        sonic = by.get((shape, layers, routing, grads, "sonicmoe"), {}).get("step_ms")
        ratio = f"{a['step_ms'] / sonic:7.3f}" if sonic else f"{'':7}"
        clock = f"{a['sm_clock_MHz']:5.0f}" if "sm_clock_MHz" in a else f"{'':5}"
        load = f"{a['load']:5.2f}" if a.get("load") else f"{'':5}"
        print(f"{head} {a['step_ms']:8.2f} {over} {ratio} {a['peak_GiB']:9.2f} {a['outside_GiB']:8.3f} "
              f"{a['peak_allocated_GiB']:9.2f} {a['reserved_after_warmup_GiB']:8.2f} {load} {clock}")


def source_commit():
    """The commit measured: git's HEAD where the tree is a checkout, else
    MOEFORGE_COMMIT (the device machine gets the files without .git)."""
    try:
        import subprocess
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return os.environ.get("MOEFORGE_COMMIT", "unknown")

if __name__ == "__main__":
    main()
