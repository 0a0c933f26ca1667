#!/usr/bin/env python3
"""PyTorch forward + backward of design.md's MoE layers with torch._grouped_mm.

The training counterpart of torch_grouped_mm.py, on the same shapes, weights
and routing: router GEMM, softmax, top-k (renormalised for SwiGLU), sort by
expert, gather, torch._grouped_mm for W1 (and W3), the activation (SwiGLU for
mixtral / fine64, GeLU(tanh) for mbpaper), torch._grouped_mm for W2, gate
scaling and the combine (index_add), then y.backward(dy) with a random
upstream gradient of y's shape. Gradients flow to x, the router weight and
every expert weight (the router's through the gates; the top-k choice is a
constant). Uniform and skewed routing (a ramp on the router logits).

Per case: forward + backward ms (CUDA events, 3 warm-up and 10 timed steps;
each step also drops the previous gradients), the grad-enabled forward alone,
TFLOP/s counting 3x design.md's forward FLOPs 2 T k d (f1 + f), and memory
above the weights and inputs: the peak during the forward (act_MiB, what
moeforge's act_MiB is compared with), what the forward leaves saved for the
backward (saved_MiB) and the peak over the whole step (step_peak_MiB, which
includes the weight gradients).

The expert GEMMs' backward is torch._grouped_mm's own autograd formula when
the installed torch has one; otherwise (or with --backward manual) an
autograd.Function written with torch._grouped_mm:
    dX[rows, K] = dOut[rows, N] . W[e]^T        (2d x 3d, groups over rows)
    dW[e]       = X[rows of e]^T . dOut[rows of e] (2d x 2d: offs then
                  partitions the contraction dimension, one [K, N] per group)
A small check compares that Function (and the native formula) with a
per-expert float32 loop before timing.

Prints one JSON object per case and a table; --out PATH also writes one JSON
document (device, date, torch version, the check, every case).
usage: python3 benchmarks/torch_grouped_mm_train.py [--out results.json]
       [--shapes mixtral,fine64] [--backward auto|native|manual] [--reps N]
       [--tiny]   (shapes scaled down 8-16x: a logic test, runs on the CPU too)
"""
import argparse
import datetime
import json
import sys
import time

try:
    import torch
except ImportError as e:  # a clear line, not a traceback
    print(f"torch_grouped_mm_train: PyTorch is not installed ({e})", file=sys.stderr)
    sys.exit(2)

SHAPES = [  # name, T, d, f, E, k, swiglu, skew ramp (as torch_grouped_mm.py)
    ("mixtral", 8192, 4096, 14336, 8, 2, True, 1.0),
    ("fine64", 16384, 2048, 1408, 64, 8, True, 0.6),
    ("mbpaper", 16384, 1024, 4096, 64, 1, False, 0.35),
    # bench_moe_train's extra shapes (benchmarks/moe_shapes.h): Qwen3-30B-A3B's
    # 128 experts with f = 768, and gpt-oss-120b's d = f = 2880.
    ("qwen3moe", 16384, 2048, 768, 128, 8, True, 0.6),
    ("gptoss", 8192, 2880, 2880, 128, 4, True, 0.6),
]

MiB = float(1 << 20)


def tiny(shape):
    """The same layer scaled down (T / 16, d and f / 8, at least 64): same E,
    k, activation and ramp; dims stay multiples of 8 (16-byte strides)."""
    name, T, d, f, E, k, swiglu, ramp = shape
    return (name + "-tiny", max(T // 16, 64), max(d // 8, 64), max(f // 8, 64), E, k, swiglu, ramp)


def forward_flops(T, d, f, k, swiglu):
    return 2.0 * T * k * d * ((2 * f if swiglu else f) + f)


# ---------------------------------------------------------------- grouped GEMM

class GroupedMM(torch.autograd.Function):
    """out[rows, N] = x[rows, K] . w[e, K, N] for the rows of group e (offs:
    int32 ends of the groups), with the backward written with _grouped_mm."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, dout):
        x, w, offs = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # 2d x 3d: dX = dOut . W[e]^T per group of rows.
            dx = torch._grouped_mm(dout, w.transpose(-2, -1), offs=offs)
        if ctx.needs_input_grad[1]:
            # 2d x 2d: offs partitions the contraction (rows); one [K, N]
            # result per group. For a column-major w ([E, N, K] storage, as
            # here) compute dW^T = dOut^T . X so dW comes out in w's layout.
            if w.stride(-2) == 1:
                dw = torch._grouped_mm(dout.transpose(-2, -1), x, offs=offs).transpose(-2, -1)
            else:
                dw = torch._grouped_mm(x.transpose(-2, -1), dout, offs=offs)
        return dx, dw, None


def make_mm(backward):
    if backward == "native":
        return lambda x, w, offs: torch._grouped_mm(x, w, offs=offs)
    return GroupedMM.apply


def native_backward_works(dev):
    """Whether torch._grouped_mm has an autograd formula here (checked on a
    tiny problem); the reason when it has not."""
    try:
        x = torch.ones(32, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(2, 24, 16, device=dev, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([16, 32], device=dev, dtype=torch.int32)
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        out.backward(torch.ones_like(out))  # a dense gradient: _grouped_mm rejects .sum()'s stride-0 one
        return x.grad is not None and w.grad is not None, ""
    except Exception as e:  # "derivative for ... is not implemented"
        return False, str(e).splitlines()[0][:200]


def check_grouped_mm(dev, backward_modes):
    """dX and dW of each backward mode against a per-expert float32 loop, on
    uneven groups with an empty one. Returns {mode: max relative error}."""
    g = torch.Generator(device=dev).manual_seed(7)
    counts = [37, 0, 100, 119]
    rows, K, N = sum(counts), 64, 48
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x0 = torch.randn(rows, K, device=dev, generator=g).bfloat16()
    wt0 = torch.randn(len(counts), N, K, device=dev, generator=g).bfloat16()  # [E, N, K] storage
    dout = torch.randn(rows, N, device=dev, generator=g).bfloat16()
    # Reference: per expert, float32.
    dx_ref = torch.zeros(rows, K, device=dev)
    dw_ref = torch.zeros(len(counts), K, N, device=dev)
    start = 0
    for e, c in enumerate(counts):
        xe, de, we = x0[start:start + c].float(), dout[start:start + c].float(), wt0[e].float().t()
        dx_ref[start:start + c] = de @ we.t()
        dw_ref[e] = xe.t() @ de
        start += c
    errors = {}
    for mode in backward_modes:
        x = x0.clone().requires_grad_()
        wt = wt0.clone().requires_grad_()
        make_mm(mode)(x, wt.transpose(-2, -1), offs).backward(dout)
        dw = wt.grad.transpose(-2, -1).float()
        err = max(((x.grad.float() - dx_ref).abs().max() / dx_ref.abs().max()).item(),
                  ((dw - dw_ref).abs().max() / dw_ref.abs().max()).item())
        errors[mode] = err
    return errors


# ---------------------------------------------------------------- the layer

def routing(x, wr, bias, k, swiglu, router_f32=False):
    # A bf16 product (nn.Linear's, what PyTorch layers and SonicMoE run)
    # rounds the logits to bf16, which ties experts a float32 router tells
    # apart; router_f32: the logits in float32, as moeforge's router and its
    # reference compute them.
    logits = (x.float() @ wr.float() if router_f32 else (x @ wr).float()) + bias
    probs = torch.softmax(logits, dim=-1)
    gate, expert = torch.topk(probs, k, dim=-1)
    if swiglu:
        gate = gate / gate.sum(-1, keepdim=True)
    return gate, expert


def forward(x, wr, bias, w1, w3, w2, k, swiglu, mm, router_f32=False):
    """torch_grouped_mm.py's forward, differentiable (mm: the grouped GEMM)."""
    T = x.shape[0]
    gate, expert = routing(x, wr, bias, k, swiglu, router_f32)
    flat = expert.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    token = order // k
    xs = x[token]
    h = mm(xs, w1, offs)
    if swiglu:
        h = torch.nn.functional.silu(h) * mm(xs, w3, offs)
    else:
        h = torch.nn.functional.gelu(h, approximate="tanh")
    o = mm(h, w2, offs)
    o = o * gate.reshape(-1)[order].unsqueeze(1).to(o.dtype)
    y = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    y.index_add_(0, token, o.float())
    return y


def make_case(dev, T, d, f, E, k, swiglu, ramp, skew):
    """torch_grouped_mm.py's inputs (same seed and scales), as trainable leaves."""
    g = torch.Generator(device=dev).manual_seed(1)
    x = (torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()
    wr = ((torch.rand(d, E, device=dev, generator=g) * 2 - 1) / d ** 0.5).bfloat16()

    def w(n_, k_):  # stored [E, N, K] (nn.Linear's layout); used as its [E, K, N] transpose
        return ((torch.rand(E, n_, k_, device=dev, generator=g) * 2 - 1) / k_ ** 0.5).bfloat16()

    w1, w2 = w(f, d), w(d, f)
    w3 = w(f, d) if swiglu else None
    bias = (ramp * torch.arange(E, device=dev) / E) if skew else torch.zeros(E, device=dev)
    dy = torch.rand(T, d, device=dev, generator=g) * 2 - 1  # upstream gradient, y's shape and dtype
    leaves = [t.requires_grad_() for t in (x, wr, w1, w2, w3) if t is not None]
    return x, wr, bias, w1, w3, w2, dy, leaves


class Timer:
    """CUDA events on a GPU, wall clock (after nothing to wait for) on the CPU."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def ms(self, fn, warmup, reps):
        for _ in range(warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / reps
        import time
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps


def run_case(dev, shape, skew, mm, backward, reps, cooldown=0.0, steady=0.0):
    sname, T, d, f, E, k, swiglu, ramp = shape
    x, wr, bias, w1, w3, w2, dy, leaves = make_case(dev, T, d, f, E, k, swiglu, ramp, skew)
    t = lambda w_: w_.transpose(-2, -1) if w_ is not None else None

    def fwd():
        return forward(x, wr, bias, t(w1), t(w3), t(w2), k, swiglu, mm)

    def step():
        for p in leaves:
            p.grad = None
        fwd().backward(dy)

    with torch.no_grad():
        _, expert = routing(x, wr, bias, k, swiglu)
        counts = torch.bincount(expert.reshape(-1), minlength=E)
        max_over_mean = (counts.max().float() / (T * k / E)).item()
        empty = int((counts == 0).sum().item())

    timer = Timer(dev)
    if dev.type == "cuda":
        # --cooldown: idle first, as bench_moe_train does with
        # MOEFORGE_BENCH_COOLDOWN_S (the clock depends on what ran before).
        torch.cuda.synchronize()
        time.sleep(cooldown)
    ms = timer.ms(step, 3, reps)
    steady_ms = None
    if dev.type == "cuda" and steady > 0:
        # --steady: the step again after the same pause and `steady` seconds of
        # steps, timed over about a second, as bench_moe_train does with
        # MOEFORGE_BENCH_STEADY_S: the clock the card's power limit keeps in
        # a continuous run, not a burst's.
        torch.cuda.synchronize()
        time.sleep(cooldown)
        steady_ms = timer.ms(step, max(1, int(steady * 1e3 / ms)), max(1, int(1e3 / ms)))
    for p in leaves:
        p.grad = None
    fwd_ms = timer.ms(lambda: fwd(), 1, reps)  # grad-enabled; the graph is dropped each time

    act = saved = step_peak = None
    if dev.type == "cuda":
        # Memory above what is already held (weights, inputs, dy): gradients
        # dropped first, so the step's peak includes the new weight gradients.
        for p in leaves:
            p.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = fwd()
        torch.cuda.synchronize()
        act = (torch.cuda.max_memory_allocated() - base) / MiB
        saved = (torch.cuda.memory_allocated() - base) / MiB
        y.backward(dy)
        del y
        torch.cuda.synchronize()
        step_peak = (torch.cuda.max_memory_allocated() - base) / MiB

    flops = 3.0 * forward_flops(T, d, f, k, swiglu)
    out = dict(shape=sname, routing="skewed" if skew else "uniform", ms=ms, tflops=flops / ms / 1e9,
               fwd_ms=fwd_ms, act_MiB=act, saved_MiB=saved, step_peak_MiB=step_peak,
               max_over_mean=max_over_mean, empty_experts=empty, flops=flops, backward=backward)
    if steady_ms is not None:
        out.update(steady_ms=steady_ms, steady_tflops=flops / steady_ms / 1e9)
    return out


def device_name(dev):
    return torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def print_table(results, dev_name):
    print(f"\nPyTorch forward + backward, torch._grouped_mm ({dev_name}, torch {torch.__version__}); "
          "TFLOP/s count 3x the forward FLOPs; MiB above weights and inputs.\n")
    print("| shape | routing | max/mean | fwd+bwd ms | TFLOP/s | fwd ms | act MiB (fwd peak) | saved MiB | step peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['shape']} | {r['routing']} | error: {r['error'][:80]} |||||||")
            continue
        print(f"| {r['shape']} | {r['routing']} | {r['max_over_mean']:.2f} | {r['ms']:.3f} | {r['tflops']:.0f} | "
              f"{r['fwd_ms']:.3f} | {fmt(r['act_MiB'], '.0f')} | {fmt(r['saved_MiB'], '.0f')} | "
              f"{fmt(r['step_peak_MiB'], '.0f')} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write every case as one JSON document here")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated subset")
    ap.add_argument("--backward", choices=["auto", "native", "manual"], default="auto",
                    help="expert GEMMs' backward: torch's autograd formula, or the _grouped_mm Function "
                         "(auto: native where it exists)")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per case")
    ap.add_argument("--cooldown", type=float, default=0.0,
                    help="seconds idle before each case's timed steps (as MOEFORGE_BENCH_COOLDOWN_S gives ours)")
    ap.add_argument("--steady", type=float, default=0.0,
                    help="also time each step after this many seconds of steps (the card's steady state, as "
                         "MOEFORGE_BENCH_STEADY_S gives ours)")
    ap.add_argument("--tiny", action="store_true", help="shapes scaled down (a logic test; CPU allowed)")
    args = ap.parse_args()

    if not hasattr(torch, "_grouped_mm"):
        print(f"torch_grouped_mm_train: torch {torch.__version__} has no torch._grouped_mm "
              "(it appeared in 2.8); nothing to measure", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif args.tiny:
        dev = torch.device("cpu")
    else:
        print("torch_grouped_mm_train: no CUDA device visible to torch (use --tiny for a CPU logic test)",
              file=sys.stderr)
        return 2
    names = args.shapes.split(",")
    unknown = [n for n in names if n not in {s[0] for s in SHAPES}]
    if unknown:
        print(f"torch_grouped_mm_train: unknown shape(s) {unknown}; known: {[s[0] for s in SHAPES]}", file=sys.stderr)
        return 2
    shapes = [tiny(s) if args.tiny else s for s in SHAPES if s[0] in names]

    native_ok, why = native_backward_works(dev)
    if args.backward == "native" and not native_ok:
        print(f"torch_grouped_mm_train: torch._grouped_mm has no usable autograd here: {why}", file=sys.stderr)
        return 2
    backward = args.backward if args.backward != "auto" else ("native" if native_ok else "manual")
    modes = ["manual"] + (["native"] if native_ok else [])
    check = check_grouped_mm(dev, modes)
    dev_name = device_name(dev)
    print(json.dumps(dict(check="grouped_mm backward vs per-expert float32 loop (max relative error)",
                          errors=check, native_autograd=native_ok, native_why=why or None, timed=backward)),
          flush=True)
    bad = {m: e for m, e in check.items() if not e < 2e-2}
    if bad:
        print(f"torch_grouped_mm_train: grouped GEMM gradients disagree with the reference: {bad}", file=sys.stderr)

    mm = make_mm(backward)
    results = []
    for shape in shapes:
        for skew in (False, True):
            routing_name = "skewed" if skew else "uniform"
            try:
                out = run_case(dev, shape, skew, mm, backward, args.reps, args.cooldown, args.steady)
            except torch.cuda.OutOfMemoryError as e:
                out = dict(shape=shape[0], routing=routing_name,
                           error="out of GPU memory: " + str(e).splitlines()[0][:250])
            except Exception as e:  # report, never hide, an unsupported case
                out = dict(shape=shape[0], routing=routing_name, error=f"{type(e).__name__}: {str(e)[:300]}")
            out.update(device=dev_name, torch=torch.__version__)
            results.append(out)
            print(json.dumps(out), flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    print_table(results, dev_name)
    if args.out:
        doc = dict(benchmark="torch_grouped_mm_train", device=dev_name,
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   torch=torch.__version__, cuda=torch.version.cuda, backward=backward,
                   native_autograd=native_ok, check=check,
                   flops="3 x 2 T k d (f1 + f), f1 = 2f for SwiGLU (design.md)", results=results)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    return 1 if bad or any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
