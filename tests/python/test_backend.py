"""The backend interface from Python: mf.backend(name) compiles a Layer or a
TrainingLayer; every backend this build has and this machine runs gives the
reference's values (bf16 storage, fp32 arithmetic: about 1e-2), and the
same mistakes are the same UserErrors. The CUDA cases skip without a GPU."""

import numpy as np
import pytest

import moeforge as mf
from conftest import build_moe_mlp, normalized_error, random_inputs, train_and_check


def _runnable():
    names = []
    for name in mf.backend_names():
        if name == "cuda" and not mf.gpu_available()[0]:
            continue
        names.append(name)
    return names


def test_an_unknown_backend_names_the_built_ones():
    with pytest.raises(mf.UserError, match="no backend 'tpu' in this build; built: ") as e:
        mf.backend("tpu")
    for name in mf.backend_names():
        assert f"'{name}'" in str(e.value)


@pytest.mark.skipif(
    "cuda" not in mf.backend_names() or mf.gpu_available()[0], reason="a build with the CUDA backend, without a GPU"
)
def test_cuda_without_a_gpu_says_why():
    with pytest.raises(mf.UserError, match="the cuda backend needs a GPU: .*; the cpu backend runs anywhere"):
        mf.backend("cuda")


@pytest.mark.parametrize("name", _runnable())
def test_forward_and_training_match_the_reference(name):
    backend = mf.backend(name)
    assert backend.name == name and backend.description.startswith(name)
    layer, y, _ = build_moe_mlp()
    inputs = random_inputs(56, seed=21)
    fwd = backend.layer(layer, mf.megablocks(), 56)
    assert isinstance(fwd, mf.Layer) and fwd.tokens == 56
    fwd.upload(inputs)
    fwd.poison()
    assert fwd.run() > 0
    assert normalized_error(fwd.download("y"), mf.evaluate(layer, inputs)["y"]) < 1e-2
    assert [s for s, _ in fwd.profile()]  # every step, named
    assert fwd.dropped_pairs("route") == 0
    # Another token count of the same forward: no compiling, its own memory.
    fwd24 = fwd.with_tokens(24)
    inputs24 = random_inputs(24, seed=25)
    fwd24.upload(inputs24)
    fwd24.run()
    assert normalized_error(fwd24.download("y"), mf.evaluate(layer, inputs24)["y"]) < 1e-2
    assert fwd.tokens == 56 and fwd24.tokens == 24

    train = backend.training_layer(layer, [y], mf.scattermoe(), 56)
    assert isinstance(train, mf.TrainingLayer)
    dy = np.random.default_rng(22).uniform(-1, 1, (56, 64))
    train_and_check(train, layer, y, inputs, dy)
    # Another token count of the same program: no compiling, its own memory.
    other = train.with_tokens(24)
    assert other.tokens == 24 and train.tokens == 56
    inputs24 = random_inputs(24, seed=23)
    train_and_check(other, layer, y, inputs24, np.random.default_rng(24).uniform(-1, 1, (24, 64)))
    with pytest.raises(mf.UserError, match="tokens must be at least 1"):
        backend.layer(layer, mf.megablocks(), 0)
    with pytest.raises(mf.UserError, match=r"layer\(pipeline, schedule, tokens\): tokens 2361183241434822606848 is beyond"):
        backend.layer(layer, mf.megablocks(), 2**71)
    with pytest.raises(mf.UserError, match=r"with_tokens: tokens must be an integer, got 'eight'"):
        train.with_tokens("eight")
    assert train.with_tokens(np.int64(16)).tokens == 16  # numpy's integers are integers
