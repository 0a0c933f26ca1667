"""The training step through moeforge.torch, against the same compiled layer
driven directly, in one process on one GPU.

For each shape: the layer written in the Python algebra (swiglu_moe or
moe_mlp, as bench_moe_train times them, without its router bias), under a
schedule file bench_moe_train wrote (MOEFORGE_WRITE_SCHEDULES), as a
moeforge.torch module. Timed with CUDA events: the mean of --iters steps
after warm-up, in --rounds rounds alternating module and layer, the median
round of each:

  module   y = moe(x); y.backward(dy)   (autograd, binding, Python)
  layer    layer.forward(); layer.backward() on the module's own compiled
           layer (no autograd, no torch tensors made), which replays its
           forward and backward graphs as bench_moe_train does
  graph    the module's step captured in a CUDA graph and replayed (it
           accumulates into .grad, as a captured training step does)

  bench    (--bench BIN) bench_moe_train's own step for the same shape
           and variant, its process run once per round between the
           module's and the layer's steps

module / layer is the cost of going through PyTorch; module / bench is
the module against the C++ benchmark, each round's processes taking
turns on the card, so both see the same clock drift.

  python3 benchmarks/torch_module_train.py --schedules DIR --variant tuned_wide_store --out results.json
      [--bench build/benchmarks/bench_moe_train]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import moeforge as mf
import moeforge.torch as mft

SHAPES = {  # name: tokens, d, f, experts, k, swiglu (benchmarks/moe_shapes.h)
    "mixtral": (8192, 4096, 14336, 8, 2, True),
    "fine64": (16384, 2048, 1408, 64, 8, True),
    "mbpaper": (16384, 1024, 4096, 64, 1, False),
    "qwen3moe": (16384, 2048, 768, 128, 8, True),
    "gptoss": (8192, 2880, 2880, 128, 4, True),
}


def time_ms(fn, iters, warmup=3, cooldown=0.0):
    # The card's clock depends on what it ran just before: a block of steps
    # right after others runs slower than one after an idle pause, such as
    # the benchmark's process start. `cooldown` seconds idle first give every
    # timed block the same start.
    torch.cuda.synchronize()
    time.sleep(cooldown)
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def bench_step_ms(bench, name, variant):
    """One bench_moe_train process timing train/<name>/uniform/<schedule>/<memory>: its ms per step."""
    schedule, memory = variant.rsplit("_", 1)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([bench, f"--benchmark_filter=^train/{name}/uniform/{schedule}/{memory}/",
                        f"--benchmark_out={out.name}", "--benchmark_out_format=json"],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out.name) as fh:
            rows = json.load(fh)["benchmarks"]
    if len(rows) != 1 or rows[0].get("error_occurred"):
        raise RuntimeError(f"bench_moe_train ran {len(rows)} benchmarks for {name} {variant}: {rows}")
    assert rows[0]["time_unit"] == "ms", rows[0]["time_unit"]
    return rows[0]["real_time"]


def run_shape(name, schedule, iters, rounds, bench=None, variant=None, cooldown=0.0):
    tokens, d, f, experts, k, swiglu = SHAPES[name]
    ex, _ = mf.make_example("swiglu_moe" if swiglu else "moe_mlp", tokens=tokens, experts=experts, topk=k, d=d, f=f)
    moe = mft.MoELayer(ex.pipeline, schedule=schedule, init_scale=dict(ex.init_scale))
    # U(-1, 1) as bench_moe_train draws x and dy: a GEMM's speed depends on
    # its data (the power it draws), so both harnesses time the same kind.
    x = (torch.rand(tokens, d, device="cuda") * 2 - 1).to(torch.bfloat16).requires_grad_(True)
    dy = torch.rand(tokens, d, device="cuda", dtype=torch.float32) * 2 - 1

    def module_step():
        x.grad = None
        moe.zero_grad(set_to_none=True)
        moe(x).backward(dy)

    t0 = time.time()
    module_step()  # compiles
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    # The module's compiled layer driven directly, on memory held for the
    # whole run: its saved activations, one workspace, the output, the
    # upstream gradient and every gradient (the module binds fresh ones
    # each step, which torch frees after it).
    rt = moe._caller
    layer = rt.layer
    part_bytes, forward_ws, backward_ws = rt.use_tokens(tokens)
    saved = [torch.empty(max(n, 1), dtype=torch.uint8, device="cuda") for n in part_bytes]
    saved_at = [t.data_ptr() for t in saved]
    held = {"workspace": torch.empty(max(forward_ws, backward_ws, 1), dtype=torch.uint8, device="cuda")}
    for name in layer.outputs + list(layer.seeds):
        dtype, shape, _, _ = layer.info(name)
        held[name] = torch.zeros(shape, dtype=mft._DTYPES[dtype], device="cuda")
        rt.bind(name, held[name])
    for of, name in layer.gradients.items():
        dtype, shape, _, _ = layer.info(name)
        held[name] = torch.empty(shape, dtype=mft._DTYPES[dtype], device="cuda")
        layer.bind_gradient(of, held[name].data_ptr(), held[name].numel() * held[name].element_size())

    def layer_step():  # on torch's current stream, as the module's steps run
        stream = torch.cuda.current_stream().cuda_stream
        layer.forward(stream, saved_at, held["workspace"].data_ptr())
        layer.backward(stream, saved_at, held["workspace"].data_ptr())

    # Alternating rounds, the median of each: the card's clock drifts over
    # seconds (a longer run is slower), so one block of module steps and one
    # of layer steps after it would compare two clocks.
    module_runs, layer_runs, bench_runs = [], [], []
    for _ in range(rounds):
        module_runs.append(time_ms(module_step, iters, cooldown=cooldown))
        if bench:
            bench_runs.append(bench_step_ms(bench, name, variant))
        layer_runs.append(time_ms(layer_step, iters, cooldown=cooldown))
    module_ms, layer_ms = statistics.median(module_runs), statistics.median(layer_runs)
    bench_ms = statistics.median(bench_runs) if bench else None

    # The module's step in a CUDA graph (gradients accumulate into the .grad
    # the warm-up made, as a captured training step does).
    def graph_body():
        moe(x).backward(dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            graph_body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_body()
    graph_ms = time_ms(graph.replay, iters, cooldown=cooldown)

    flops = 3 * 2.0 * tokens * k * d * ((2.0 if swiglu else 1.0) * f + f)
    row = {
        "shape": name,
        "schedule": schedule.name,
        "module_ms": module_ms,
        "graph_ms": graph_ms,
        "layer_ms": layer_ms,
        "module_rounds_ms": module_runs,
        "layer_rounds_ms": layer_runs,
        "module_over_layer": module_ms / layer_ms,
        "bench_ms": bench_ms,
        "bench_rounds_ms": bench_runs,
        "module_over_bench": module_ms / bench_ms if bench else None,
        "module_TFLOPs": flops / (module_ms * 1e-3) / 1e12,
        "saved_MiB": moe.saved_bytes(tokens) / 2 ** 20,
        "compile_s": compile_s,
        "cooldown_s": cooldown,
    }
    print(f"{name:9s} module {module_ms:7.3f} ms  graph {graph_ms:7.3f} ms  layer {layer_ms:7.3f} ms  "
          f"module/layer {module_ms / layer_ms:.3f}  compile {compile_s:.1f} s" +
          (f"  bench {bench_ms:7.3f} ms  module/bench {module_ms / bench_ms:.3f}" if bench else ""), flush=True)
    del moe, layer, graph
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", required=True, help="folder of <shape>_<variant>.sched files (bench_moe_train)")
    ap.add_argument("--variant", default="tuned_wide_store")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of module and layer steps (medians)")
    ap.add_argument("--bench", help="bench_moe_train binary: time its step once per round too (module / bench)")
    ap.add_argument("--cooldown", type=float, default=3.0,
                    help="seconds idle before each timed block (as the benchmark's process start gives it)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        path = os.path.join(args.schedules, f"{name}_{args.variant}.sched")
        if not os.path.exists(path):
            print(f"torch_module_train: no schedule file {path}: run bench_moe_train with "
                  f"MOEFORGE_WRITE_SCHEDULES={args.schedules} first", file=sys.stderr)
            return 2
        rows.append(run_shape(name, mf.Schedule.load(path), args.iters, args.rounds, args.bench, args.variant,
                              args.cooldown))
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "torch": torch.__version__, "variant": args.variant, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
