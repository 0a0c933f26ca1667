"""The roof's data dependence, outside our code: torch.matmul (cuBLAS) on
bf16 operands of 1.0 against random ones, mbpaper's first forward GEMM and
8192^3, with the SM clock and board power sampled by NVML while each runs."""
import json
import threading
import time

import torch

try:
    import pynvml
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
except Exception:  # no NVML bindings: nvidia-smi's numbers are then not sampled
    pynvml = None


def sample(stop, out):
    while not stop.is_set():
        if pynvml:
            out.append((pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0))
        time.sleep(0.01)


def run(m, n, k, fill, seconds=2.0):
    if fill == "ones":
        a = torch.ones(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.ones(k, n, device="cuda", dtype=torch.bfloat16)
    else:
        a = torch.rand(m, k, device="cuda", dtype=torch.bfloat16) * 2 - 1
        b = torch.rand(k, n, device="cuda", dtype=torch.bfloat16) * 2 - 1
    for _ in range(5):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    stop, samples = threading.Event(), []
    t = threading.Thread(target=sample, args=(stop, samples))
    t.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            torch.matmul(a, b)
        reps += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    stop.set()
    t.join()
    ms = start.elapsed_time(end) / reps
    late = samples[len(samples) // 2:] or [(0, 0)]
    return {"m": m, "n": n, "k": k, "inputs": fill, "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12,
            "sm_mhz": sum(s[0] for s in late) / len(late), "watts": sum(s[1] for s in late) / len(late)}


for shape in [(16384, 4096, 1024), (16384, 1024, 4096), (8192, 8192, 8192)]:
    for fill in ["ones", "random", "ones", "random"]:
        print(json.dumps(run(*shape, fill)), flush=True)
