"""The Eigen reference from Python, against the same layer written in numpy:
two independent implementations of one algebra."""

import numpy as np
import pytest

import moeforge as mf
from conftest import build_moe_mlp, gelu_tanh, random_inputs


def numpy_moe_mlp(inputs, k):
    x, wr, w1, w2 = inputs["x"], inputs["wr"], inputs["w1"], inputs["w2"]
    logits = x @ wr
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    # top_k: the k largest, ties to the lower expert (a stable sort of -probs).
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e in experts[t]:
            y[t] += probs[t, e] * (gelu_tanh(x[t] @ w1[e]) @ w2[e])
    return y, experts


def test_reference_forward_matches_numpy():
    layer, _, _ = build_moe_mlp()
    inputs = random_inputs(80, seed=1)
    ref = mf.evaluate(layer, inputs)
    y, experts = numpy_moe_mlp(inputs, 2)
    # Funcs stored in bf16 (h, o) are rounded in the reference too: bf16's
    # half an ulp, relative.
    assert np.abs(ref["y"] - y).max() / np.abs(y).max() < 1e-2
    route = ref.routes["route"]
    assert route["k"] == 2
    assert route["expert"].dtype == np.int32
    np.testing.assert_array_equal(route["expert"].reshape(80, 2), experts)
    np.testing.assert_array_equal(route["token"], np.repeat(np.arange(80), 2))


def test_reference_gradient_of_w2_matches_numpy():
    """d_w2[e] = sum over pairs routed to e of h(r)^T (gate(r) d_y(t))."""
    layer, y, _ = build_moe_mlp()
    inputs = random_inputs(48, seed=2)
    g = mf.grad(layer, [y])
    dy = np.random.default_rng(3).uniform(-1, 1, (48, 64))
    ref = mf.evaluate(g.pipeline, {**inputs, g.seed: dy})
    fwd = mf.evaluate(layer, inputs)
    h, gate = fwd["h"], fwd["route_gate"]
    route = fwd.routes["route"]
    dw2 = np.zeros_like(inputs["w2"])
    for r, (t, e) in enumerate(zip(route["token"], route["expert"])):
        dw2[e] += np.outer(h[r], gate[r] * dy[t])
    got = ref[g.of["w2"].name]
    assert np.abs(got - dw2).max() / np.abs(dw2).max() < 1e-2


def test_evaluate_refuses_bad_inputs_with_the_message():
    layer, _, _ = build_moe_mlp()
    inputs = random_inputs(16)
    with pytest.raises(mf.UserError, match="w1"):
        mf.evaluate(layer, {k: v for k, v in inputs.items() if k != "w1"})
    with pytest.raises(mf.UserError, match="precision must be 'f32' or 'f64', got 'f16'"):
        mf.evaluate(layer, inputs, precision="f16")
    with pytest.raises(mf.UserError, match="input 'x' has dtype complex128; give float64, float32"):
        mf.evaluate(layer, {**inputs, "x": inputs["x"].astype(np.complex128)})
    with pytest.raises(mf.UserError, match="input 'x' is a <class 'list'>, not an array"):
        mf.evaluate(layer, {**inputs, "x": [[1.0]]})
    with pytest.raises(mf.UserError, match="input names must be strings"):
        mf.evaluate(layer, {**inputs, 3: inputs["x"]})


def test_example_layers_come_ready_made():
    assert "moe_mlp" in mf.example_names()
    ex, shape = mf.make_example("swiglu_moe", tokens=32, experts=4, topk=2, d=64, f=64)
    inputs = ex.random_inputs(shape, seed=5)
    assert inputs["x"].shape == (32, 64)
    assert mf.evaluate(ex.pipeline, inputs)[ex.output].shape == (32, 64)
    with pytest.raises(mf.UserError, match="unknown example 'nosuch'"):
        mf.make_example("nosuch")
