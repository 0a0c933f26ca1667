"""Shared layers for the Python package's tests."""

import types

import numpy as np
import pytest

import moeforge as mf


def gelu_tanh(x):
    """The tanh form of GeLU, as the algebra's gelu computes it."""
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def moe_mlp_parts(d=64, f=128, experts=8, k=2):
    """The README's layer, written in Python, and its pieces by name (t, e,
    probs, route, y, ...), for tests that add to it."""
    T, D, F, E = mf.Dim.dynamic("T"), mf.Dim("D", d), mf.Dim("F", f), mf.Dim("E", experts)
    t, e, i, j = mf.Var("t", T), mf.Var("e", E), mf.Var("i", D), mf.Var("j", F)
    x = mf.Input("x", [T, D])
    wr, w1, w2 = mf.Param("wr", [D, E]), mf.Param("w1", [E, D, F]), mf.Param("w2", [E, F, D])
    logits, probs = mf.Func("logits", mf.f32), mf.Func("probs", mf.f32)
    logits[t, e] = mf.sum(i, x[t, i] * wr[i, e])
    probs[t, e] = mf.softmax(e, logits[t, e])
    route = mf.top_k(probs, e, k)
    r = route.pair
    h, o, y = mf.Func("h"), mf.Func("o"), mf.Func("y")
    h[r, j] = mf.gelu(mf.sum(i, x[route.token(r), i] * w1[route.expert(r), i, j]))
    o[r, i] = mf.sum(j, h[r, j] * w2[route.expert(r), j, i])
    y[t, i] = mf.combine(route, t, route.gate(r) * o[r, i])
    return types.SimpleNamespace(t=t, e=e, probs=probs, route=route, y=y)


def build_moe_mlp(d=64, f=128, experts=8, k=2):
    """The README's layer: returns (pipeline, y, route)."""
    m = moe_mlp_parts(d, f, experts, k)
    return mf.Pipeline([m.y]), m.y, m.route


def bf16_exact(a):
    """Rounds float64 values to bfloat16 (nearest, ties to even) so every
    backend reads the same numbers."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def random_inputs(tokens, d=64, f=128, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    sd, sf = 1.0 / np.sqrt(d), 1.0 / np.sqrt(f)
    return {
        "x": bf16_exact(rng.uniform(-1, 1, (tokens, d))),
        "wr": bf16_exact(rng.uniform(-sd, sd, (d, experts))),
        "w1": bf16_exact(rng.uniform(-sd, sd, (experts, d, f))),
        "w2": bf16_exact(rng.uniform(-sf, sf, (experts, f, d))),
    }


def normalized_error(got, ref):
    """max |got - ref| / max |ref|; NaN (an element nothing wrote) is infinite."""
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape
    if np.isnan(got).any():
        return np.inf
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def train_and_check(train, layer, y, inputs, dy):
    """One training step on `train` (a CpuTrainingLayer or CudaTrainingLayer
    over the README's layer), outputs poisoned first, checked against the
    reference: y within 1e-2 and every gradient within 2e-2. Returns the
    reference gradients by Input or Param name."""
    g = mf.grad(layer, [y])
    got = mf.evaluate(g.pipeline, {**inputs, g.seed: dy})
    ref = {name: got[g.of[name].name] for name in inputs}
    train.upload(inputs)
    train.poison()
    train.forward()
    train.upload_upstream_gradient(dy)
    train.backward()
    assert normalized_error(train.output(), mf.evaluate(layer, inputs)["y"]) < 1e-2
    for name, want in ref.items():
        assert normalized_error(train.gradient(name), want) < 2e-2, name
    return ref


cpu_only = pytest.mark.skipif(not mf.has_cpu_backend, reason="moeforge was built without the LLVM CPU backend")
