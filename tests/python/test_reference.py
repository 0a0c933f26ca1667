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


def test_an_impossible_example_shape_is_told_in_python_spelling():
    """make_example's shape errors name its keyword arguments (topk=5), not
    the CLI's flags (--topk 5), which Python callers never typed."""
    cases = [(dict(experts=4, topk=5), r"moe_mlp: topk=5 with 4 experts: choose 1 <= topk <= experts"),
             (dict(tokens=0), r"moe_mlp: tokens must be at least 1 \(got 0\)"),
             (dict(tokens=2**30, topk=4), r"tokens=1073741824 x topk=4 pairs is beyond .* lower tokens or topk"),
             (dict(experts=2**20, d=2**20, f=2**30, topk=1), r"a tensor of experts=1048576 x d=1048576 x f=1073741824")]
    for kwargs, message in cases:
        with pytest.raises(mf.UserError, match=message) as got:
            mf.make_example("moe_mlp", **kwargs)
        assert "--" not in str(got.value), str(got.value)
    if mf.has_cpu_backend:  # a training layer of no outputs: told in the words of a training step
        ex, _ = mf.make_example("moe_mlp", tokens=8)
        with pytest.raises(mf.UserError, match="a training step needs at least one output to differentiate"):
            mf.CpuTrainingLayer(ex.pipeline, [], mf.preset("scattermoe"), 8)


def test_expert_choice_reference_matches_numpy():
    """Each expert takes its top C = ceil(cf T / E) tokens by probability."""
    d, f, experts, tokens, cf = 64, 128, 8, 80, 2.0
    T, D, F, E = mf.Dim.dynamic("T"), mf.Dim("D", d), mf.Dim("F", f), mf.Dim("E", experts)
    t, e, i, j = mf.Var("t", T), mf.Var("e", E), mf.Var("i", D), mf.Var("j", F)
    x = mf.Input("x", [T, D])
    wr, w1, w2 = mf.Param("wr", [D, E]), mf.Param("w1", [E, D, F]), mf.Param("w2", [E, F, D])
    logits, probs = mf.Func("logits", mf.f32), mf.Func("probs", mf.f32)
    logits[t, e] = mf.sum(i, x[t, i] * wr[i, e])
    probs[t, e] = mf.softmax(e, logits[t, e])
    route = mf.expert_choice(probs, e, cf)
    r = route.pair
    h, o, y = mf.Func("h", mf.f32), mf.Func("o", mf.f32), mf.Func("y")
    h[r, j] = mf.gelu(mf.sum(i, x[route.token(r), i] * w1[route.expert(r), i, j]))
    o[r, i] = mf.sum(j, h[r, j] * w2[route.expert(r), j, i])
    y[t, i] = mf.combine(route, t, route.gate(r) * o[r, i])
    inputs = random_inputs(tokens, seed=3)
    ref = mf.evaluate(mf.Pipeline([y]), inputs)

    xs = inputs["x"]
    lg = xs @ inputs["wr"]
    p = np.exp(lg - lg.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    capacity = int(np.ceil(cf * tokens / experts))
    want = np.zeros_like(xs)
    for ex in range(experts):
        chosen = np.argsort(-p[:, ex], kind="stable")[:capacity]  # ties to the earlier token
        for tok in chosen:
            want[tok] += p[tok, ex] * (gelu_tanh(xs[tok] @ inputs["w1"][ex]) @ inputs["w2"][ex])
    assert np.abs(ref["y"] - want).max() / np.abs(want).max() < 1e-2
    assert ref.routes["route"]["dropped"] == tokens * experts - experts * capacity


def test_schedule_capacity_round_trips():
    s = mf.Schedule("capped")
    s.capacity(1.25)
    assert "capacity(1.25)" in s.to_text()
    with pytest.raises(mf.UserError, match="must be a positive number"):
        s.capacity(0.0)
