"""The CUDA backend from Python with host arrays (moeforge.CudaTrainingLayer):
gradients against the reference on the GPU; without one, a UserError that
says so (CI has no GPU)."""

import numpy as np
import pytest

import moeforge as mf
from conftest import build_moe_mlp, random_inputs, train_and_check

needs_backend = pytest.mark.skipif(not mf.has_cuda_backend, reason="moeforge was built without the CUDA backend")
gpu = mf.gpu_available()


@needs_backend
@pytest.mark.skipif(gpu[0], reason="a GPU is present")
def test_without_a_gpu_the_layer_says_why():
    layer, y, _ = build_moe_mlp()
    with pytest.raises(mf.UserError, match="the CUDA backend needs a GPU: .*use the CPU backend"):
        mf.CudaTrainingLayer(layer, [y], mf.scattermoe(), 64)
    with pytest.raises(mf.UserError, match="the CUDA backend needs a GPU: .*use the CPU backend"):
        mf.CudaCallerLayer(layer, mf.scattermoe(), 64)


@needs_backend
def test_tune_refuses_what_it_cannot_time_before_looking_for_a_gpu():
    layer, _, _ = build_moe_mlp()
    with pytest.raises(mf.UserError, match=r"tune\(tokens=0\): tuning times the layer at a token count"):
        mf.tune(layer, 0)
    with pytest.raises(mf.UserError, match=r"tune\(budget_seconds=-1\): give a budget"):
        mf.tune(layer, 64, budget_seconds=-1)


@needs_backend
@pytest.mark.skipif(gpu[0], reason="a GPU is present")
def test_without_a_gpu_tune_says_why():
    # After making the request's inputs, its upstream gradient and its
    # skewed routing (the router is x wr), for the forward and the step.
    layer, _, _ = build_moe_mlp()
    for training in (True, False):
        with pytest.raises(mf.UserError, match="the CUDA backend needs a GPU"):
            mf.tune(layer, 64, training=training, budget_seconds=1)


@needs_backend
@pytest.mark.skipif(not gpu[0], reason=f"no GPU: {gpu[1]}")
@pytest.mark.parametrize("schedule", ["megablocks", "scattermoe"])
def test_gradients_on_the_gpu_match_the_reference(schedule):
    layer, y, _ = build_moe_mlp()
    tokens = 136
    inputs = random_inputs(tokens, seed=31)
    dy = np.random.default_rng(32).uniform(-1, 1, (tokens, 64))
    train = mf.CudaTrainingLayer(layer, [y], mf.preset(schedule), tokens)
    train_and_check(train, layer, y, inputs, dy)
    assert train.info("x") == ("bf16", (tokens, 64), True, tokens * 64 * 2)
    with pytest.raises(mf.UserError, match="bind of 'x': 8 bytes given"):
        train.bind("x", 0, 8)
