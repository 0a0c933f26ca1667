"""The LLVM CPU backend from Python: forward and training against the Eigen
reference (bf16 storage, fp32 arithmetic: about 1e-2), outputs poisoned
first; arrays in any strides, dtype or through DLPack; mistakes as
UserErrors with the C++ message."""

import numpy as np
import pytest

import moeforge as mf
from conftest import build_moe_mlp, cpu_only, normalized_error, random_inputs, train_and_check

pytestmark = cpu_only

TOKENS = 72  # not a multiple of the block: the last block is partial


@pytest.mark.parametrize("schedule", ["megablocks", "scattermoe"])
def test_forward_matches_the_reference(schedule):
    layer, _, _ = build_moe_mlp()
    inputs = random_inputs(TOKENS, seed=11)
    ref = mf.evaluate(layer, inputs)
    cpu = mf.CpuLayer(layer, mf.preset(schedule), TOKENS)
    cpu.upload(inputs)
    cpu.poison()  # what no step writes stays NaN; nothing is a result until the run
    with pytest.raises(mf.UserError, match=r"no step has computed 'y' .* \(or the layer was poisoned\)"):
        cpu.download("y")
    cpu.run()
    assert normalized_error(cpu.download("y"), ref["y"]) < 1e-2
    assert normalized_error(cpu.download("h"), ref["h"]) < 1e-2
    np.testing.assert_array_equal(cpu.routed_experts("route"), ref.routes["route"]["expert"])
    assert cpu.tokens == TOKENS


def test_training_gradients_match_the_reference():
    layer, y, _ = build_moe_mlp()
    inputs = random_inputs(TOKENS, seed=12)
    dy = np.random.default_rng(13).uniform(-1, 1, (TOKENS, 64))
    train = mf.CpuTrainingLayer(layer, [y], mf.scattermoe(), TOKENS)
    assert train.outputs == ["y"] and train.seeds == ["d_y"]
    ref = train_and_check(train, layer, y, inputs, dy)
    assert train.gradients == {"x": "d_x", "wr": "d_wr", "w1": "d_w1", "w2": "d_w2"}
    assert train.saved_bytes > 0
    # A second backward after a new upstream gradient, without a new forward.
    train.upload_upstream_gradient(-dy, "y")
    train.backward()
    assert normalized_error(train.gradient("w2"), -ref["w2"]) < 2e-2


def test_results_never_computed_are_refused_not_zeros():
    """output() before forward(), gradient() before backward(), and y after
    new inputs: each an error that says what to run, never stale values."""
    layer, y, _ = build_moe_mlp()
    train = mf.CpuTrainingLayer(layer, [y], mf.scattermoe(), TOKENS)
    inputs = random_inputs(TOKENS, seed=15)
    train.upload(inputs)
    with pytest.raises(mf.UserError, match="no step has computed 'y'"):
        train.output()
    train.forward()
    assert train.output().shape == (TOKENS, 64)
    with pytest.raises(mf.UserError, match="no step has computed 'd_w1'"):
        train.gradient("w1")
    train.upload(random_inputs(TOKENS, seed=16))
    with pytest.raises(mf.UserError, match="since the inputs it is made from were last given"):
        train.output()
    cpu = mf.CpuLayer(layer, mf.scattermoe(), TOKENS)
    with pytest.raises(mf.UserError, match="run the layer first"):
        cpu.download("y")


def test_recompute_trains_to_the_same_gradients():
    layer, y, _ = build_moe_mlp()
    inputs = random_inputs(40, seed=14)
    dy = np.random.default_rng(15).uniform(-1, 1, (40, 64))
    got = {}
    for recompute in (False, True):
        train = mf.CpuTrainingLayer(layer, [y], mf.scattermoe().recompute(recompute), 40)
        train.upload(inputs)
        train.forward()
        train.upload_upstream_gradient(dy)
        train.backward()
        got[recompute] = (train.gradient("w1"), train.saved_bytes)
    assert normalized_error(got[True][0], got[False][0]) < 1e-2
    assert got[True][1] < got[False][1]


def test_any_strides_and_dtypes_read_the_same_values():
    layer, _, _ = build_moe_mlp()
    inputs = random_inputs(TOKENS, seed=16)
    cpu = mf.CpuLayer(layer, mf.scattermoe(), TOKENS)
    cpu.upload(inputs)
    cpu.run()
    want = cpu.download("y")
    # x as a transposed view, w1 as float32 (values are bf16-exact), wr
    # every other column of a wider array, w2 reversed twice (negative strides).
    wide = np.zeros((64, 16))
    wide[:, ::2] = inputs["wr"]
    views = {
        "x": np.ascontiguousarray(inputs["x"].T).T,
        "w1": inputs["w1"].astype(np.float32),
        "wr": wide[:, ::2],
        "w2": inputs["w2"][::-1][::-1],
    }
    assert not views["x"].flags["C_CONTIGUOUS"] and not views["wr"].flags["C_CONTIGUOUS"]
    cpu.upload(views)
    cpu.run()
    np.testing.assert_array_equal(cpu.download("y"), want)


class DLPackOnly:
    """An array that offers nothing but the DLPack protocol."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_dlpack_round_trip():
    layer, _, _ = build_moe_mlp()
    inputs = random_inputs(TOKENS, seed=17)
    cpu = mf.CpuLayer(layer, mf.megablocks(), TOKENS)
    cpu.upload({name: DLPackOnly(a) for name, a in inputs.items()})
    cpu.run()
    y = cpu.download("y")
    assert y.dtype == np.float64 and y.shape == (TOKENS, 64)
    back = np.from_dlpack(y)
    assert back.ctypes.data == y.ctypes.data  # a view, not a copy
    cpu.upload("x", DLPackOnly(back[:, :64] * 0 + inputs["x"]))
    cpu.run()
    np.testing.assert_array_equal(cpu.download("y"), y)


def test_mistakes_are_user_errors_that_say_what_to_change():
    layer, y, _ = build_moe_mlp()
    inputs = random_inputs(TOKENS)
    cpu = mf.CpuLayer(layer, mf.scattermoe(), TOKENS)
    with pytest.raises(mf.UserError, match="upload"):
        cpu.run()  # nothing uploaded: it would compute on zeros
    with pytest.raises(mf.UserError, match=r"input 'x' has shape \(71, 64\), and at 72 tokens the layer takes"):
        cpu.upload({**inputs, "x": inputs["x"][:-1]})
    with pytest.raises(mf.UserError, match="has dtype bool"):
        cpu.upload("x", inputs["x"] > 0)
    with pytest.raises(mf.UserError, match="nosuch"):
        cpu.upload("nosuch", inputs["x"])
    cpu.upload(inputs)
    cpu.run()
    with pytest.raises(mf.UserError, match="nosuch"):
        cpu.download("nosuch")
    with pytest.raises(mf.UserError, match="tokens must be at least 1"):
        mf.CpuLayer(layer, mf.scattermoe(), 0)
    with pytest.raises(mf.UserError, match="tile_m"):
        mf.CpuLayer(layer, mf.Schedule.from_text("tile(\"*\", 64, 128, 32)\nblock(128)\nblock(64)\ntile(\"*\", 128, 128, 32)"), 8)
    train = mf.CpuTrainingLayer(layer, [y], mf.scattermoe(), TOKENS)
    train.upload(inputs)
    with pytest.raises(mf.UserError, match="forward"):
        train.backward()
    train.forward()
    with pytest.raises(mf.UserError, match="upstream gradient"):
        train.backward()
    with pytest.raises(mf.UserError, match="nosuch"):
        train.upload_upstream_gradient(np.zeros((TOKENS, 64)), "nosuch")
    with pytest.raises(mf.UserError, match="nosuch"):
        train.gradient("nosuch")


def test_a_layer_too_large_for_the_host_is_refused_before_it_is_allocated():
    layer, y, _ = build_moe_mlp()
    with pytest.raises(mf.UserError, match=r"the CPU backend's tensors of this layer at 268435456 tokens needs "
                                           r"[0-9.]+ GiB of host memory, and [0-9.]+ GiB is available: lower the "
                                           r"token count"):
        mf.CpuTrainingLayer(layer, [y], mf.scattermoe(), 2**28)


def test_inputs_of_a_dtype_no_layer_reads_or_the_wrong_shape_say_which():
    layer, _, _ = build_moe_mlp()
    cpu = mf.CpuLayer(layer, mf.scattermoe(), 8)
    inputs = random_inputs(8, seed=1)
    for bad in (np.array([[object()] * 64] * 8, dtype=object), np.array([["a"] * 64] * 8),
                np.zeros((8, 64), dtype=[("a", "f4")]), np.zeros((8, 64), dtype=np.longdouble)):
        with pytest.raises(mf.UserError, match=r"input 'x' has dtype .*; give float64, float32, float16, bfloat16"):
            cpu.upload({**inputs, "x": bad})
    with pytest.raises(mf.UserError, match=r"input 'x' has shape \(7, 64\), and at 8 tokens the layer takes "
                                           r"\(8, 64\) \(T, D\)"):
        cpu.upload({**inputs, "x": np.zeros((7, 64), dtype=np.float32)})
    # One array at a time, and the upstream gradient: the same words, not
    # nanobind's "incompatible function arguments".
    with pytest.raises(mf.UserError, match=r"input 'x' has dtype object; give float64"):
        cpu.upload("x", np.array([[object()] * 64] * 8, dtype=object))
    layer, y, _ = build_moe_mlp()
    train = mf.CpuTrainingLayer(layer, [y], mf.scattermoe(), 8)
    with pytest.raises(mf.UserError, match=r"the upstream gradient of 'y' is a <class 'str'>, not an array"):
        train.upload_upstream_gradient("zeros")


def test_a_training_layer_names_its_own_entry_points_and_python_spellings():
    layer, y, _ = build_moe_mlp()
    train = mf.CpuTrainingLayer(layer, [y], mf.scattermoe(), 8)
    with pytest.raises(mf.UserError, match=r"forward\(\) before upload\(\) of 'x'"):
        train.forward()
    # Expert parallelism is C++'s and the CLI's for now: the advice says so.
    with pytest.raises(mf.UserError, match=r"in C\+\+ \(the CLI: moeforge train --ranks 2; Python has no "
                                           r"expert-parallel layer yet\)"):
        mf.CpuLayer(layer, mf.Schedule.from_text(mf.scattermoe().to_text() + "expert_parallel(2)\n"), 8)
    with pytest.raises(mf.UserError, match=r"byte 0x00 is not text; .* as a schedule's save\(\) writes it"):
        mf.Schedule.from_text("schedule(\"x\")\nblock(128)\x00\n")
