#!/usr/bin/env python3
"""FP8 operands in training against bf16 (issue #55, item 3): a residual
stack of moeforge SwiGLU MoE layers learns a fixed random teacher, once with
the default schedule (bf16 operands, f32 sums) and once with the same
schedule and every expert product's operands in FP8 (`fp8("*")`, the
router's product and its weight gradient left as they are), from the same
initial weights and the same batches. Reports both loss curves, the mean
loss over the last 10 % of steps and the gap between them.

The CPU backend runs the rounding exactly as the reference defines it
(dsl/fp8.h), so the curve is the recipe's, whatever device later runs it
faster. Each layer's weight gradients need per-pair operands there, hence
gather_upstream_in_gemms(False) in both runs.

usage: python3 benchmarks/fp8_accuracy.py [--steps 500] [--tokens 256] [--d 128] [--f 256]
       [--experts 8] [--topk 2] [--layers 2] [--lr 2e-3] [--format e4m3] [--funcs *|h,o,...]
       [--device cpu|cuda] [--task regress|classify] [--classes C] [--seeds N] [--perturbed]
       [--out results.json]
"""
import argparse
import datetime
import json
import time

import torch

import moeforge as mf
import moeforge.torch as mft


def schedule_for(pipeline, outputs, fp8_format, funcs):
    s = mf.default_schedule(pipeline, outputs).gather_upstream_in_gemms(False)
    if fp8_format and funcs == "*":
        s.fp8("*", fp8_format).fp8("logits", None).fp8("d_wr", None)
    elif fp8_format:
        for f in funcs.split(","):
            s.fp8(f, fp8_format)
    return s


class Stack(torch.nn.Module):
    def __init__(self, args, fp8_format, seed, perturb=False):
        super().__init__()
        ex, _ = mf.make_example("swiglu_moe", tokens=1, experts=args.experts, topk=args.topk, d=args.d, f=args.f)
        outputs = list(ex.pipeline.outputs)
        torch.manual_seed(seed)  # the same initial weights for both runs
        self.layers = torch.nn.ModuleList(
            mft.MoELayer(ex.pipeline, schedule=schedule_for(ex.pipeline, outputs, fp8_format, args.funcs),
                         init_scale=dict(ex.init_scale), device=args.device) for _ in range(args.layers))
        if perturb:
            # Every nonzero initial weight moved to its bf16 neighbour, up
            # or down at random (one unit of its bit pattern): a run that
            # differs from the bf16 one by one rounding, to show how far two
            # such trajectories part by the end (chaos, not bias).
            g = torch.Generator().manual_seed(seed + 1000)
            with torch.no_grad():
                for w in self.parameters():
                    assert w.dtype == torch.bfloat16, "the perturbation moves bf16 bit patterns"
                    bits = w.view(torch.int16)
                    step = (torch.randint(0, 2, w.shape, generator=g) * 2 - 1).to(torch.int16).to(w.device)
                    bits.add_(torch.where(w != 0, step, torch.zeros_like(step)))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def teacher(args, device):
    """A fixed random two-layer MLP the stack learns (f32): d outputs
    (regress), or --classes logits scaled by TEACHER_SCALE (classify)."""
    g = torch.Generator().manual_seed(99)
    outputs = args.classes if args.task == "classify" else args.d
    a = torch.randn(args.d, 4 * args.d, generator=g) / args.d**0.5
    b = torch.randn(4 * args.d, outputs, generator=g) / (4 * args.d)**0.5
    if args.task == "classify":
        b *= TEACHER_SCALE
    return a.to(device), b.to(device)


# classify: the teacher's logits have a spread of about this many nats, so
# its labels carry about 2.76 nats of entropy a token out of ln 64 = 4.16:
# the loss has a floor, as a language model's does, and FP8's noise in the
# student's output adds to it rather than to a residual shrinking to 0.
TEACHER_SCALE = 3.0


def run(args, fp8_format, seed=1, perturb=False):
    model = Stack(args, fp8_format, seed=seed, perturb=perturb)
    params = list(model.parameters())
    head = None
    if args.task == "classify":  # an f32 read-out from the stack to the classes, trained with it
        torch.manual_seed(seed + 2000)
        head = torch.nn.Linear(args.d, args.classes).to(args.device)
        params += list(head.parameters())
    opt = torch.optim.Adam(params, lr=args.lr)
    a, b = teacher(args, args.device)
    data = torch.Generator().manual_seed(6 + seed)  # the same batches for both runs of a seed
    losses, floors = [], []
    start = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(args.tokens, args.d, generator=data).to(args.device)
        target = torch.tanh(x @ a) @ b
        y = model(x.to(torch.bfloat16))
        if head is None:
            loss = torch.nn.functional.mse_loss(y.float(), target)
        else:
            # Labels drawn from the teacher's distribution (the same draws
            # for every run of a seed); the floor is its entropy.
            probs = torch.softmax(target, dim=1)
            labels = torch.multinomial(probs.cpu(), 1, generator=data).squeeze(1).to(args.device)
            loss = torch.nn.functional.cross_entropy(head(y.float()), labels)
            floors.append(-(probs * torch.log_softmax(target, dim=1)).sum(1).mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    floor = sum(floors) / len(floors) if floors else None  # classify: the labels' mean entropy
    return losses, time.perf_counter() - start, floor


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--f", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--format", default="e4m3", choices=["e4m3", "e5m2"])
    p.add_argument("--funcs", default="*",
                   help="the Funcs whose products take FP8 operands, comma-separated (default: every expert "
                        "product, forward and backward; e.g. h,o,d_h,d_x for the weight gradients in bf16)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--task", default="regress", choices=["regress", "classify"],
                   help="regress: MSE to the teacher's outputs (the loss falls towards 0); classify: cross-entropy "
                        "on labels drawn from the teacher's softmax (a floor at its entropy, as a language model's)")
    p.add_argument("--classes", type=int, default=64)
    p.add_argument("--seeds", type=int, default=1, help="seeds (initial weights and batches) to average over")
    p.add_argument("--perturbed", action="store_true",
                   help="per seed, bf16 again from weights moved by one bf16 rounding: the yardstick for the gap")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    if args.seeds > 1 or args.perturbed:
        return several_seeds(args)
    bf16, t_bf16, _ = run(args, None)
    fp8, t_fp8, _ = run(args, args.format)
    tail = max(1, args.steps // 10)
    last_bf16 = sum(bf16[-tail:]) / tail
    last_fp8 = sum(fp8[-tail:]) / tail
    gap = (last_fp8 - last_bf16) / last_bf16
    print(f"{args.steps} steps, {args.layers} layers (T {args.tokens}, d {args.d}, f {args.f}, E {args.experts}, "
          f"k {args.topk}), {args.device}")
    print(f"first loss {bf16[0]:.5f} (bf16) / {fp8[0]:.5f} ({args.format})")
    print(f"mean loss over the last {tail} steps: bf16 {last_bf16:.5f}, {args.format} {last_fp8:.5f}: "
          f"gap {100 * gap:+.2f} %")
    print(f"time: bf16 {t_bf16:.1f} s, {args.format} {t_fp8:.1f} s (the CPU backend: not a speed measurement)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "device": args.device, "args": vars(args), "format": args.format,
                       "loss_bf16": bf16, "loss_fp8": fp8, "tail_steps": tail, "tail_bf16": last_bf16,
                       "tail_fp8": last_fp8, "gap": gap}, f, indent=1)


def several_seeds(args):
    """Per seed (initial weights and batches): bf16, the FP8 run and, with
    --perturbed, bf16 again from weights moved by one rounding. The FP8 gap
    means something only beside the perturbed run's: both runs part from
    bf16's trajectory, and a gap no larger than rounding's own is no bias."""
    tail = max(1, args.steps // 10)
    mean = lambda xs: sum(xs) / len(xs)
    per_seed, floors = [], []
    for seed in range(1, args.seeds + 1):
        bf16, _, floor = run(args, None, seed)
        floors.append(floor)
        runs = {"bf16": bf16, args.format: run(args, args.format, seed)[0]}
        if args.perturbed:
            runs["bf16_perturbed"] = run(args, None, seed, perturb=True)[0]
        tails = {name: mean(losses[-tail:]) for name, losses in runs.items()}
        gaps = {name: (t - tails["bf16"]) / tails["bf16"] for name, t in tails.items() if name != "bf16"}
        per_seed.append({"seed": seed, "tails": tails, "gaps": gaps, "losses": runs})
        print(f"seed {seed}: mean loss over the last {tail} steps " +
              ", ".join(f"{n} {t:.5f}" for n, t in tails.items()) + "; gaps to bf16 " +
              ", ".join(f"{n} {100 * g:+.2f} %" for n, g in gaps.items()), flush=True)
    floor = mean(floors) if floors[0] is not None else None  # the seeds' batches differ a little
    if floor is not None:
        print(f"the labels' entropy (the loss's floor): {floor:.4f} nats a token")
    names = list(per_seed[0]["gaps"])
    summary = {}
    for n in names:
        gs = [s["gaps"][n] for s in per_seed]
        # The gap of the seeds' mean tails: one seed's swing averages out.
        pooled = mean([s["tails"][n] for s in per_seed]) / mean([s["tails"]["bf16"] for s in per_seed]) - 1
        summary[n] = {"mean_gap": mean(gs), "max_abs_gap": max(abs(g) for g in gs), "pooled_gap": pooled}
        print(f"{n}: gap over {len(gs)} seeds mean {100 * mean(gs):+.2f} %, largest {100 * max(abs(g) for g in gs):.2f} %"
              f", of the mean tails {100 * pooled:+.2f} %")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "device": args.device, "args": vars(args), "format": args.format, "tail_steps": tail,
                       "seeds": per_seed, "summary": summary, "label_entropy": floor}, f, indent=1)

if __name__ == "__main__":
    main()
