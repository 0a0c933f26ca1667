"""benchmarks/torch_decode.py: the decode sweep's correctness column. The
reference's router must compute its logits in float32 as moeforge's does:
torch's bf16 product ties experts at bf16's rounding, and a token sent to
another expert differs by its whole output (the first GPU sweep read
0.3-0.7 "errors" so, from about 16 tokens on). Tiny shapes on the CPU
backend."""

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moeforge.torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import moeforge as mf  # noqa: E402
import torch_decode  # noqa: E402

D, F, E, K = 64, 64, 16, 4
# The moeforge columns run on the CPU backend (the GPU machine's build has none).
needs_cpu_backend = pytest.mark.skipif(not mf.has_cpu_backend, reason="no CPU backend")


def case(T):
    w = torch_decode.weights(D, F, E, torch.device("cpu"))
    x = (torch.rand(T, D, generator=torch.Generator().manual_seed(T)) * 2 - 1).bfloat16()
    return w, x


@needs_cpu_backend
@pytest.mark.parametrize("T", [1, 37, 300])
def test_the_forward_alone_matches_a_float32_router_at_every_count(T):
    w, x = case(T)
    layer = torch_decode.moeforge_layer(*w, K)
    want = torch_decode.TorchLayer(*w, K, router_f32=True)
    with torch.inference_mode():
        got, ref = layer(x).float(), want(x).float()
    assert (got - ref).abs().max().item() / ref.abs().max().item() < 2e-2


def test_a_bf16_router_ties_experts_that_a_float32_one_tells_apart():
    w, x = case(300)
    with torch.inference_mode():
        bf16 = torch_decode.TorchLayer(*w, K).experts(x)
        f32 = torch_decode.TorchLayer(*w, K, router_f32=True).experts(x)
    differs = (bf16 != f32).any(-1)
    assert 0 < differs.sum().item() < 300  # some tokens, not all: the routers agree elsewhere


@needs_cpu_backend
def test_the_sweep_writes_a_column_per_schedule_file(tmp_path):
    """--schedules: each file is one more moeforge column (moeforge_<stem>),
    checked like the default's; the JSON holds every row's times, modes and
    errors."""
    import json
    import subprocess
    out = tmp_path / "sweep.json"
    sched = ROOT / "benchmarks" / "schedules" / "decode" / "decode_n64.sched"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_decode.py"), "--tiny", "--device", "cpu",
                    "--impls", "moeforge,torch", "--shapes", "qwen3moe", "--tokens", "1,5", "--reps", "2",
                    "--inputs", "2", "--schedules", str(sched), "--out", str(out)], check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 5]
    for r in rows:
        for impl in ("moeforge", "moeforge_decode_n64"):
            assert r[f"{impl}_us"] > 0 and r[f"{impl}_mode"] == "eager"
            assert r[f"{impl}_err"] < 2e-2
