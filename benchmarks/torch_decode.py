#!/usr/bin/env python3
"""One MoE layer's forward alone (serving: no backward) over a sweep of token
counts, moeforge against torch._grouped_mm and SonicMoE, on the same weights
and inputs, beside the memory-bandwidth limit (issue #53).

Per shape (mixtral, qwen3moe, gptoss: SwiGLU experts, softmax router) and
token count T (decode: 1, 2, 4, ..., 256; prefill: 4096, 16384): the mean
of --reps forwards, CUDA events around each, after a warm-up of its own and
a pause, over --inputs random inputs in turn (the experts hit vary, and
the limit is their mean count), each forward the replay of a CUDA graph of
it where the implementation can be captured (a server captures its
decoding step per batch size: the host's launches are not the forward's
time), else eager (the row's `<impl>_mode` says which); moeforge through
moeforge.torch under torch.inference_mode() (the forward alone on caller
memory), torch._grouped_mm's layer (torch_grouped_mm_train.py's forward)
under inference_mode, SonicMoE's MoE module in inference mode where it
is installed. The limit is the bytes of the experts the T tokens hit on
average, E (1 - (1 - k / E)^T) experts of 3 d f bf16 values, read at
the card's copy bandwidth (a device-to-device copy of 2 GiB timed in the
same run), or the dense roof's time for the forward's FLOPs (--roof
TFLOP/s, 989 for an H200's bf16 by default) where that is longer. Each
row also gives each implementation's output against torch's layer (max
|impl - torch| / max |torch|), so that a fast wrong output shows: moeforge
against torch's layer with its router's logits in float32, as moeforge's
are (a bf16 product ties experts at bf16's rounding, and a token routed to
another expert differs by its whole output), SonicMoE against torch's bf16
router, its own; `router_ties` is the fraction of tokens whose experts the
two routers choose differently.

usage: python3 benchmarks/torch_decode.py [--shapes mixtral,qwen3moe,gptoss]
       [--tokens 1,2,4,...,256,4096,16384] [--impls moeforge,torch,sonicmoe]
       [--reps 50] [--out results.json] [--device cuda|cpu] [--profile N]
       [--schedules a.sched,b.sched] [--tune SECONDS]
       [--tiny] [--device cpu]   (d, f / 16 and the CPU backend: a logic test)
"""
import argparse
import collections
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_grouped_mm_train as tgm  # noqa: E402

SHAPES = {name: (d, f, E, k) for name, _, d, f, E, k, swiglu, _ in tgm.SHAPES if swiglu}
DECODE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL = [4096, 16384]


def weights(d, f, E, dev, seed=3):
    """W1, W3 [E, d, f], W2 [E, f, d], wr [d, E] in bf16, U(-1, 1) / sqrt(fan-in)."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def u(*shape, fan_in):
        return ((torch.rand(*shape, device=dev, generator=g) * 2 - 1) / fan_in ** 0.5).bfloat16()

    return u(E, d, f, fan_in=d), u(E, d, f, fan_in=d), u(E, f, d, fan_in=f), u(d, E, fan_in=d)


class TorchLayer:
    def __init__(self, w1, w3, w2, wr, k, router_f32=False):
        self.w = (w1, w3, w2, wr)
        self.k = k
        self.router_f32 = router_f32
        self.bias = torch.zeros(wr.shape[1], device=wr.device)

    def __call__(self, x):
        w1, w3, w2, wr = self.w
        return tgm.forward(x, wr, self.bias, w1, w3, w2, self.k, True, tgm.make_mm("native"), self.router_f32)

    def experts(self, x):
        """Each token's chosen experts, as a sorted [T, k] tensor."""
        _, e = tgm.routing(x, self.w[3], self.bias, self.k, True, self.router_f32)
        return e.sort(dim=-1).values


def moeforge_layer(w1, w3, w2, wr, k, schedule="auto"):
    import moeforge.torch as mft
    E, d, f = w1.shape
    m = mft.example("swiglu_moe", experts=E, topk=k, d=d, f=f, device=w1.device.type, schedule=schedule)
    with torch.no_grad():
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2), ("wr", wr)):
            getattr(m, name).copy_(w)
    return m


def sonic_layer(w1, w3, w2, wr, k):
    from sonicmoe.enums import ActivationType, KernelBackendMoE
    from sonicmoe.moe import MoE
    E, d, f = w1.shape
    m = MoE(E, k, d, f, ActivationType.SWIGLU, add_bias=False, std=0.02).to(wr.device).bfloat16()
    with torch.no_grad():
        m.router.weight.copy_(wr.t())
        m.c_fc.weight[:, 0::2, :].copy_(w1.transpose(1, 2))
        m.c_fc.weight[:, 1::2, :].copy_(w3.transpose(1, 2))
        m.c_proj.weight.copy_(w2.transpose(1, 2))
    m.eval()
    return lambda x: m(x, kernel_backend_moe=KernelBackendMoE.sonicmoe, is_inference_mode=True)[0]


def tune_buckets(d, f, E, k, counts, seconds):
    """`moeforge tune` of the forward (moeforge.tune, training=False) for
    each power-of-two bucket of `counts`, `seconds` each, before the
    module's first forward there: under "auto" its forward then runs the
    schedule found for the bucket (#53: decoding's schedules found by the
    tuner). Returns {count: the tuner's base_ms, best_ms and schedule}."""
    import moeforge as mf
    ex, _ = mf.make_example("swiglu_moe", tokens=1, experts=E, topk=k, d=d, f=f)
    out, done = {}, {}
    for T in counts:
        bucket = 1 << (T - 1).bit_length()
        if bucket not in done:
            s, info = mf.tune(ex.pipeline, bucket, training=False, budget_seconds=seconds)
            done[bucket] = {"bucket": bucket, "base_ms": info["base_ms"], "best_ms": info["best_ms"],
                            "schedule": s.to_text()}
            print(f"  tuned {bucket} tokens: {info['base_ms']:.4f} -> {info['best_ms']:.4f} ms", file=sys.stderr,
                  flush=True)
        out[T] = done[bucket]
    return out


def copy_bandwidth(dev):
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * src.numel() * 10 / (a.elapsed_time(b) / 1e3)


def limit_us(T, d, f, E, k, bandwidth, roof_tflops):
    experts_hit = E * (1 - (1 - k / E) ** T)
    read = experts_hit * 3 * d * f * 2 / bandwidth
    compute = 2.0 * T * k * d * 3 * f / (roof_tflops * 1e12)
    return 1e6 * max(read, compute)


def time_us(fn, xs, reps, dev):
    """The mean of `reps` forwards, µs, over the inputs `xs` in turn: the
    experts the tokens hit vary from input to input, and the limit is their
    mean count. Eager on the CPU; on the GPU from a CUDA graph of one
    forward where the implementation can be captured (as a server captures
    its decoding step per batch size, so the time is the forward's, not the
    host's launches), its input copied in before each replay, outside the
    timed span; else eager. Returns (µs, mode, a forward to profile)."""
    with torch.inference_mode():
        for x in xs:
            fn(x)
        if dev.type != "cuda":
            times = []
            for i in range(reps):
                t0 = time.perf_counter()
                fn(xs[i % len(xs)])
                times.append(1e6 * (time.perf_counter() - t0))
            return statistics.fmean(times), "eager", lambda: fn(xs[0])
        torch.cuda.synchronize()
        static = xs[0].clone()
        run, mode = (lambda: fn(static)), "eager"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(static)  # the warm-up torch's capture asks for, on a side stream
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(static)
            graph.replay()
            torch.cuda.synchronize()
            run, mode = graph.replay, "graph"
        except Exception as e:  # a host synchronisation or a host-sized tensor: not capturable
            print(f"  not captured ({type(e).__name__}: {str(e).splitlines()[0][:120]}): timed eagerly",
                  file=sys.stderr, flush=True)
            torch.cuda.synchronize()
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        time.sleep(0.2)
        times = []
        for i in range(reps):
            static.copy_(xs[i % len(xs)])
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(1e3 * a.elapsed_time(b))
        return statistics.fmean(times), mode, run


def kernels_us(run, reps):
    """torch.profiler's kernel records over `reps` forwards: [(µs per
    forward, launches per forward, name)], longest first."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    by = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by[ev.name][0] += ev.device_time / reps
            by[ev.name][1] += 1
    return sorted(((us, n / reps, name) for name, (us, n) in by.items()), reverse=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mixtral,qwen3moe,gptoss")
    ap.add_argument("--tokens", default=",".join(str(t) for t in DECODE + PREFILL))
    ap.add_argument("--impls", default="moeforge,torch,sonicmoe")
    ap.add_argument("--reps", type=int, default=48)
    ap.add_argument("--inputs", type=int, default=8,
                    help="random inputs per row, timed in turn (the experts hit vary; the limit is their mean)")
    ap.add_argument("--roof", type=float, default=989.0, help="dense bf16 TFLOP/s for the limit's compute side")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="d and f / 16 (at least 64): a logic test")
    ap.add_argument("--tune", type=float, default=0,
                    help="seconds: tune moeforge's forward for each token count's bucket first (GPU only; "
                         "ten seconds a bucket left the tuner no candidate past its base on an H100: give it minutes)")
    ap.add_argument("--schedules", default="",
                    help="schedule files, comma-separated: moeforge's forward with each too (moeforge_<stem>)")
    ap.add_argument("--profile", type=int, default=0,
                    help="N > 0: each implementation's kernels over N forwards (torch.profiler), per row; with "
                         "moeforge's early launches a kernel's time includes its wait for the one before "
                         "(MOEFORGE_NO_EARLY_LAUNCH=1: each kernel's own)")
    ap.add_argument("--width", type=int, default=90, help="kernel names shortened to this")
    ap.add_argument("--out")
    a = ap.parse_args()
    # Each schedule file: one more moeforge column, "moeforge_<file's stem>".
    schedules = [("moeforge_" + os.path.splitext(os.path.basename(p))[0], p) for p in a.schedules.split(",") if p]
    columns = a.impls.split(",") + [name for name, _ in schedules]
    dev = torch.device(a.device)
    if a.tune and dev.type != "cuda":
        raise SystemExit("--tune times schedules on the GPU: drop it, or run with --device cuda")
    bandwidth = copy_bandwidth(dev) if dev.type == "cuda" else 4.8e12
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for shape in a.shapes.split(","):
        d, f, E, k = SHAPES[shape]
        if a.tiny:
            d, f = max(d // 16 // 8 * 8, 64), max(f // 16 // 8 * 8, 64)
        w = weights(d, f, E, dev)
        tuned = tune_buckets(d, f, E, k, [int(t) for t in a.tokens.split(",")], a.tune) if a.tune else {}
        impls = {}
        for impl in a.impls.split(","):
            try:
                impls[impl] = {"moeforge": moeforge_layer, "torch": TorchLayer, "sonicmoe": sonic_layer}[impl](*w, k)
            except ImportError as e:
                print(f"  {impl}: not installed ({e})", file=sys.stderr)
        for name, path in schedules:
            import moeforge as mf
            with open(path) as fh:
                impls[name] = moeforge_layer(*w, k, schedule=mf.Schedule.from_text(fh.read()))
        for T in (int(t) for t in a.tokens.split(",")):
            gen = torch.Generator(device=dev).manual_seed(T)
            xs = [((torch.rand(T, d, device=dev, generator=gen) * 2 - 1).bfloat16()) for _ in range(a.inputs)]
            x = xs[0]  # the one the outputs are checked on
            row = {"shape": shape, "tokens": T, "limit_us": limit_us(T, d, f, E, k, bandwidth, a.roof)}
            if T in tuned:
                row["tuned"] = tuned[T]
            for impl, fn in impls.items():
                row[f"{impl}_us"], row[f"{impl}_mode"], run = time_us(fn, xs, a.reps, dev)
                if a.profile and dev.type == "cuda":
                    ks = kernels_us(run, a.profile)
                    row[f"{impl}_kernels"] = [[round(us, 2), n, name[:120]] for us, n, name in ks]
                    print(f"  {shape} T={T} {impl}: kernels {sum(k[0] for k in ks):.1f} us of "
                          f"{row[impl + '_us']:.1f}", file=sys.stderr)
                    for us, n, name in ks[:12]:
                        print(f"    {us:8.2f} us  x{n:g}  {name[:a.width]}", file=sys.stderr)
            # What each computed, against torch's layer on the same weights
            # with the implementation's router precision: a fast row of a
            # wrong output would otherwise read as a win.
            with torch.inference_mode():
                bf16_router, f32_router = TorchLayer(*w, k), TorchLayer(*w, k, router_f32=True)
                row["router_ties"] = (bf16_router.experts(x) != f32_router.experts(x)).any(-1).float().mean().item()
                for impl, fn in impls.items():
                    if impl != "torch":
                        want = (f32_router if impl.startswith("moeforge") else bf16_router)(x).float()
                        scale = max(want.abs().max().item(), 1e-30)
                        row[f"{impl}_err"] = (fn(x).float() - want).abs().max().item() / scale
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':9s} {'T':>6s} {'limit us':>9s} " + " ".join(f"{i.replace('moeforge_decode_', 'dec_').replace('moeforge_', '')[:9] + ' us':>12s}" for i in columns) +
          "  moeforge / limit  worst err  router ties")
    for r in rows:
        # g: timed from a CUDA graph, e: eagerly (host launches included)
        cells = " ".join(f"{r.get(i + '_us', float('nan')):11.1f}{r.get(i + '_mode', '?')[0]}" for i in columns)
        ratio = r.get("moeforge_us", float("nan")) / r["limit_us"]
        print(f"{r['shape']:9s} {r['tokens']:6d} {r['limit_us']:9.1f} {cells}  {ratio:16.2f}  "
              f"{max((v for c, v in r.items() if c.startswith('moeforge') and c.endswith('_err')), default=float('nan')):9.1e}"
              f"  {r['router_ties']:11.3f}")
    if a.out:
        with open(a.out, "w") as out:
            json.dump({"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "torch": torch.__version__, "copy_bandwidth": bandwidth, "roof_tflops": a.roof,
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
