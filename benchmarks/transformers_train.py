#!/usr/bin/env python3
"""transformers' MoE models trained with moeforge's experts beside
transformers' own (#52's table): per model kind (Mixtral, Qwen3-MoE, OLMoE,
DeepSeek-V3), one small model made from one seed, copied, and trained --steps
AdamW steps on the same token batches (--distinct of them, in turn) with each experts implementation
(`model.set_experts_implementation(...)`: "grouped_mm", transformers'
torch._grouped_mm one, and "moeforge", registered by moeforge.transformers)
and with the sparse blocks swapped whole ("swap": the router in moeforge's
algebra too, mftf.swap_sparse_moe_blocks).

Per kind and implementation: the loss at the last step and its gap to
grouped_mm's (relative), the largest gap over the run's last tenth, the
median step ms (CUDA events, after --warmup steps) and the device memory at
the peak: torch's peak reserved bytes plus what is allocated outside torch's
caching allocator (cudaMemGetInfo's change less torch's reserved change).
Writes JSON (--out) and prints a markdown table.

usage: python3 benchmarks/transformers_train.py [--kinds mixtral,qwen3moe,olmoe,deepseek_v3]
       [--impls grouped_mm,moeforge,swap] [--steps 200] [--batch 8] [--seq 512] [--distinct 8] [--device cuda|cpu]
       [--small] [--out results.json]
"""
import argparse
import copy
import datetime
import json
import statistics
import time

import torch
import transformers

import moeforge.transformers as mftf

GiB = float(1 << 30)


def config(kind, small):
    """A small model of `kind`: a few layers of width 1024 (64 with --small)
    and 32 experts of 512 (8 of 128), top-k as the kind routes."""
    d, f, E, layers = (64, 128, 8, 2) if small else (1024, 512, 32, 4)
    shared = dict(vocab_size=4096 if not small else 96, hidden_size=d, num_hidden_layers=layers,
                  num_attention_heads=8 if not small else 4, max_position_embeddings=2048)
    if kind == "mixtral":
        return transformers.MixtralForCausalLM, transformers.MixtralConfig(
            **shared, intermediate_size=f, num_key_value_heads=2, head_dim=d // shared["num_attention_heads"],
            num_local_experts=E, num_experts_per_tok=2, router_jitter_noise=0.0)
    if kind == "qwen3moe":
        return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **shared, intermediate_size=2 * f, moe_intermediate_size=f, num_key_value_heads=2,
            head_dim=d // shared["num_attention_heads"], num_experts=E, num_experts_per_tok=4, norm_topk_prob=True)
    if kind == "olmoe":
        return transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
            **shared, intermediate_size=f, num_key_value_heads=shared["num_attention_heads"], num_experts=E,
            num_experts_per_tok=4)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
            **shared, intermediate_size=2 * f, moe_intermediate_size=f, first_k_dense_replace=0,
            num_key_value_heads=shared["num_attention_heads"], q_lora_rank=None, kv_lora_rank=64,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=E, num_experts_per_tok=4,
            n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)
    raise SystemExit(f"unknown kind '{kind}': mixtral, qwen3moe, olmoe, deepseek_v3")


def used_bytes(dev):
    if dev.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(dev)
    return total - free


def train(model, impl, batches, warmup, dev):
    """The loss curve, the median step ms after `warmup` steps, and the peak
    device memory of a training run of `model` under `impl`."""
    if impl == "swap":
        mftf.swap_sparse_moe_blocks(model)
    else:
        model.set_experts_implementation(impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        used0, reserved0 = used_bytes(dev), torch.cuda.memory_reserved(dev)
    losses, times = [], []
    for step, tokens in enumerate(batches):
        start = time.perf_counter()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        if cuda:
            end.record()
            end.synchronize()
            elapsed = begin.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - start) * 1e3
        losses.append(loss.item())
        if step >= warmup:
            times.append(elapsed)
    peak = outside = 0.0
    if cuda:
        torch.cuda.synchronize(dev)
        reserved = torch.cuda.memory_reserved(dev)
        outside = max(0, (used_bytes(dev) - used0) - (reserved - reserved0))
        peak = (torch.cuda.max_memory_reserved(dev) + outside) / GiB
    return losses, statistics.median(times) if times else float("nan"), peak, outside / GiB


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="mixtral,qwen3moe,olmoe,deepseek_v3")
    ap.add_argument("--impls", default="grouped_mm,moeforge,swap")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--distinct", type=int, default=8, help="distinct batches, trained in turn")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny models (a CPU check of this script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    impls = a.impls.split(",")
    if impls[0] != "grouped_mm":
        raise SystemExit("--impls must start with grouped_mm, the curve the others are compared with")
    rows = []
    for kind in a.kinds.split(","):
        cls, cfg = config(kind, a.small)
        torch.manual_seed(0)
        base = cls(cfg).to(device=dev, dtype=torch.bfloat16)
        # A few batches in turn: a model can learn them, so the loss falls
        # and the curves have something to agree on.
        g = torch.Generator(device="cpu").manual_seed(1)
        distinct = [torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g).to(dev) for _ in range(a.distinct)]
        batches = [distinct[s % a.distinct] for s in range(a.steps)]
        reference = None
        for impl in impls:
            model = copy.deepcopy(base)
            losses, ms, peak, outside = train(model, impl, batches, a.warmup, dev)
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if reference is None:
                reference = losses
            tail = max(1, len(losses) // 10)
            gaps = [abs(x - r) / r for x, r in zip(losses[-tail:], reference[-tail:])]
            rows.append({"kind": kind, "impl": impl, "loss_first": losses[0], "loss_last": losses[-1],
                         "gap_last": abs(losses[-1] - reference[-1]) / reference[-1], "gap_tail_max": max(gaps),
                         "step_ms": ms, "peak_gib": peak, "outside_gib": outside, "losses": losses})
            r = rows[-1]
            print(f"{kind:12s} {impl:10s} loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}  gap {100 * r['gap_last']:.2f} % "
                  f"(tail max {100 * r['gap_tail_max']:.2f} %)  {ms:.2f} ms  peak {peak:.2f} GiB", flush=True)
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"\n{device}, {datetime.date.today()}, {a.steps} steps of {a.batch} x {a.seq} tokens\n")
    print("| model | experts | loss at the last step | gap to grouped_mm | largest gap, last tenth | step ms | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['impl']} | {r['loss_last']:.4f} | {100 * r['gap_last']:.2f} % | "
              f"{100 * r['gap_tail_max']:.2f} % | {r['step_ms']:.2f} | {r['peak_gib']:.2f} |")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"device": device, "date": str(datetime.date.today()), "steps": a.steps, "batch": a.batch,
                       "seq": a.seq, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
