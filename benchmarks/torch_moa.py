#!/usr/bin/env python3
"""Mixture-of-Attention (heads as experts, keys and values shared: the `moa`
example) through moeforge.torch beside a PyTorch MoA written the way a
PyTorch user would: the routed query and output projections as
torch._grouped_mm over the pairs sorted by head, and the attention between
them as one scaled_dot_product_attention (flash) call of every pair's query
against every token's key and value (issue #54, item 3).

Same weights and inputs for both (bf16, U(-1, 1) / sqrt(fan-in)); the
router's logits in float32 in both (a bf16 router ties heads at bf16's
rounding, and a pair routed to another head differs by its whole output).
Per shape (T tokens, E heads, top-k, model width d, head width f): the
forward alone (inference_mode) and the training step (forward, then the
backward from one upstream gradient), each the median of --reps after a
warm-up and a pause (CUDA events on the GPU), with torch's peak allocated
bytes above the weights during them (both implementations allocate through
torch's caching allocator), and moeforge's output and x's gradient against
torch's (max |moeforge - torch| / max |torch|).

moeforge runs its default schedule (the scores' GEMM, the softmax and p v
as kernels, p stored) and `fused_attention(true)` (the forward one kernel,
the backward two that make p again from each row's log-sum-exp; nothing
stored over T x T) as a column of its own.

usage: python3 benchmarks/torch_moa.py [--shapes T:E:k,...] [--d 2048] [--f 128]
       [--reps 10] [--out results.json] [--device cuda|cpu] [--tiny]
"""
import argparse
import datetime
import json
import statistics
import sys
import time

import torch

SHAPES = "4096:16:4,4096:8:2,16384:16:4,16384:32:2"


def weights(d, f, E, dev, seed=5):
    """moa's Params: wr [d, E], wq [E, d, f], wk [d, f], wv [d, f], wo [E, f, d]."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def u(*shape, fan_in):
        return ((torch.rand(*shape, device=dev, generator=g) * 2 - 1) / fan_in ** 0.5).bfloat16()

    return {"wr": u(d, E, fan_in=d), "wq": u(E, d, f, fan_in=d), "wk": u(d, f, fan_in=d), "wv": u(d, f, fan_in=d),
            "wo": u(E, f, d, fan_in=f)}


def expert_mm(rows, w, counts):
    """rows [P, K] sorted by expert (counts[e] of expert e) times w[e] [K, N]:
    torch._grouped_mm on the GPU, an expert at a time on the CPU."""
    if rows.is_cuda:
        return torch._grouped_mm(rows, w, offs=torch.cumsum(counts, 0).to(torch.int32))
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        out.append(rows[start:start + n] @ w[e])
        start += n
    return torch.cat(out)


class TorchMoA(torch.nn.Module):
    """The same layer in PyTorch: route, sort the pairs by head, project
    each pair's query with its head's W_q, attend every token by SDPA, take
    each pair's result back with its head's W_o, and add a token's pairs by
    their gates."""

    def __init__(self, w, k):
        super().__init__()
        self.k = k
        for name, t in w.items():
            setattr(self, name, torch.nn.Parameter(t.clone()))

    def forward(self, x):
        T, E = x.shape[0], self.wr.shape[1]
        probs = torch.softmax(x.float() @ self.wr.float(), dim=-1)
        gate, head = torch.topk(probs, self.k, dim=-1)
        flat = head.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        token = order // self.k
        q = expert_mm(x[token], self.wq, counts)  # [P, f], pairs sorted by head
        key, value = x @ self.wk, x @ self.wv
        z = torch.nn.functional.scaled_dot_product_attention(q[None, None], key[None, None], value[None, None])[0, 0]
        o = expert_mm(z, self.wo, counts) * gate.reshape(-1)[order].unsqueeze(1).to(z.dtype)
        y = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
        y.index_add_(0, token, o.float())
        return y.to(x.dtype)


def moeforge_moa(w, k, d, f, E, dev, fused=False):
    import moeforge as mf
    import moeforge.torch as mft
    schedule = "auto"
    if fused:
        ex = mf.make_example("moa", tokens=1, experts=E, topk=k, d=d, f=f)[0]
        schedule = mf.default_schedule(ex.pipeline).fused_attention(True)
    m = mft.example("moa", experts=E, topk=k, d=d, f=f, device=dev.type, schedule=schedule)
    with torch.no_grad():
        for name, t in w.items():
            getattr(m, name).copy_(t)
    return m


def timed(fn, reps, dev):
    """The median ms of `reps` calls of fn after a warm-up, and the peak
    bytes torch allocated during them above what was allocated before."""
    for _ in range(2):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        time.sleep(0.5)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else 0
    return statistics.median(times), peak


def error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="T:E:k, comma-separated (tokens, heads as experts, top-k)")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--f", type=int, default=128, help="a head's width")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="d 64, f 32, T / 64 (at least 37): a logic test")
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device(a.device)
    d, f = (64, 32) if a.tiny else (a.d, a.f)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}: moa, d {d}, head width {f}", flush=True)
    rows = []
    for spec in a.shapes.split(","):
        T, E, k = (int(v) for v in spec.split(":"))
        if a.tiny:
            T = max(T // 64, 37)
        w = weights(d, f, E, dev)
        gen = torch.Generator(device=dev).manual_seed(T)
        x = ((torch.rand(T, d, device=dev, generator=gen) * 2 - 1).bfloat16())
        dy = ((torch.rand(T, d, device=dev, generator=gen) * 2 - 1).bfloat16())
        impls = {"moeforge": moeforge_moa(w, k, d, f, E, dev), "torch": TorchMoA(w, k).to(dev)}
        fused = moeforge_moa(w, k, d, f, E, dev, fused=True)
        row = {"tokens": T, "heads": E, "k": k, "d": d, "f": f}
        outs, grads = {}, {}
        for impl, m in list(impls.items()) + [("moeforge_fused", fused)]:
            with torch.inference_mode():
                row[f"{impl}_forward_ms"], row[f"{impl}_forward_bytes"] = timed(lambda: m(x), a.reps, dev)
                outs[impl] = m(x)

            def step():
                xg = x.detach().requires_grad_()
                m.zero_grad(set_to_none=True)
                m(xg).backward(dy)
                return xg.grad

            row[f"{impl}_step_ms"], row[f"{impl}_step_bytes"] = timed(step, a.reps, dev)
            grads[impl] = step()
        row["moeforge_y_err"] = error(outs["moeforge"], outs["torch"])
        row["moeforge_fused_y_err"] = error(outs["moeforge_fused"], outs["torch"])
        row["moeforge_dx_err"] = error(grads["moeforge"], grads["torch"])
        row["moeforge_fused_dx_err"] = error(grads["moeforge_fused"], grads["torch"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    MiB = float(1 << 20)
    print(f"\n{'T':>6s} {'E':>3s} {'k':>2s}  forward ms (moeforge / fused / torch)   step ms (moeforge / fused / torch)"
          "   step MiB above weights (moeforge / fused / torch)   errors y, y fused, dx, dx fused")
    for r in rows:
        print(f"{r['tokens']:6d} {r['heads']:3d} {r['k']:2d}  {r['moeforge_forward_ms']:9.3f} "
              f"{r['moeforge_fused_forward_ms']:9.3f} {r['torch_forward_ms']:9.3f}       "
              f"{r['moeforge_step_ms']:9.3f} {r['moeforge_fused_step_ms']:9.3f} {r['torch_step_ms']:9.3f}      "
              f"{r['moeforge_step_bytes'] / MiB:10.1f} {r['moeforge_fused_step_bytes'] / MiB:10.1f} "
              f"{r['torch_step_bytes'] / MiB:10.1f}       {r['moeforge_y_err']:.1e} {r['moeforge_fused_y_err']:.1e} "
              f"{r['moeforge_dx_err']:.1e} {r['moeforge_fused_dx_err']:.1e}")
    if a.out:
        with open(a.out, "w") as out:
            json.dump({"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "torch": torch.__version__, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
