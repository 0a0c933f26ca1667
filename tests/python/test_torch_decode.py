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
import torch_decode  # noqa: E402

D, F, E, K = 64, 64, 16, 4


def case(T):
    w = torch_decode.weights(D, F, E, torch.device("cpu"))
    x = (torch.rand(T, D, generator=torch.Generator().manual_seed(T)) * 2 - 1).bfloat16()
    return w, x


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
