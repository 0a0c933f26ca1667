#!/usr/bin/env python3
"""PyTorch's grouped GEMM on design.md's MoE shapes, for the table beside ours.

The same forward as moeforge's: router GEMM, softmax, top-k (renormalised for
SwiGLU), sort by expert, gather, torch._grouped_mm for W1 (and W3), the
activation, torch._grouped_mm for W2, gate scaling and the combine
(index_add). Uniform and skewed routing (a ramp on the router logits, as the
C++ benchmark). Prints one JSON object per case; timings by CUDA events.
"""
import json
import sys
import time

import torch

SHAPES = [  # name, T, d, f, E, k, swiglu, skew ramp
    ("mixtral", 8192, 4096, 14336, 8, 2, True, 1.0),
    ("fine64", 16384, 2048, 1408, 64, 8, True, 0.6),
    ("mbpaper", 16384, 1024, 4096, 64, 1, False, 0.35),
]


def forward(x, wr, bias, w1, w3, w2, k, swiglu):
    T = x.shape[0]
    logits = (x @ wr).float() + bias
    probs = torch.softmax(logits, dim=-1)
    gate, expert = torch.topk(probs, k, dim=-1)
    if swiglu:
        gate = gate / gate.sum(-1, keepdim=True)
    flat = expert.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w1, offs=offs)
    if swiglu:
        h = torch.nn.functional.silu(h) * torch._grouped_mm(xs, w3, offs=offs)
    else:
        h = torch.nn.functional.gelu(h, approximate="tanh")
    o = torch._grouped_mm(h, w2, offs=offs)
    o = o * gate.reshape(-1)[order].unsqueeze(1).to(o.dtype)
    y = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    y.index_add_(0, order // k, o.float())
    return y


def main():
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    for (sname, T, d, f, E, k, swiglu, ramp) in SHAPES:
        for skew in (False, True):
            g = torch.Generator(device=dev).manual_seed(1)
            x = (torch.rand(T, d, device=dev, generator=g) * 2 - 1).bfloat16()
            wr = ((torch.rand(d, E, device=dev, generator=g) * 2 - 1) / d ** 0.5).bfloat16()
            # Weights [E, N, K] transposed to [E, K, N]: the layout grouped_mm prefers for B.
            def w(n_, k_):
                return ((torch.rand(E, n_, k_, device=dev, generator=g) * 2 - 1) / k_ ** 0.5).bfloat16().transpose(-2, -1)
            w1, w2 = w(f, d), w(d, f)
            w3 = w(f, d) if swiglu else None
            bias = (ramp * torch.arange(E, device=dev) / E) if skew else torch.zeros(E, device=dev)
            fn = lambda: forward(x, wr, bias, w1, w3, w2, k, swiglu)
            try:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                reps = 10
                a.record()
                for _ in range(reps):
                    fn()
                b.record()
                torch.cuda.synchronize()
                ms = a.elapsed_time(b) / reps
                flops = 2.0 * T * k * d * ((2 * f if swiglu else f) + f)
                out = dict(shape=sname, routing="skewed" if skew else "uniform", ms=ms, tflops=flops / ms / 1e9,
                           device=name, torch=torch.__version__)
            except Exception as e:  # report, never hide, an unsupported case
                out = dict(shape=sname, routing="skewed" if skew else "uniform", error=str(e)[:300], device=name)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
