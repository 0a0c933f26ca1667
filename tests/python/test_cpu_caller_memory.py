"""The CPU backend's training layer on caller memory from Python
(mf.CpuCallerTrainingLayer): forwards in flight at different token counts,
each backward on its own forward's saved memory, one compiled program, the
same gradients as the layer on its own memory; misuse refused with what to
call. moeforge.torch runs its CPU device through this layer (tested with
torch in test_torch.py, where torch is installed)."""

import numpy as np
import pytest

import moeforge as mf
from conftest import build_moe_mlp, cpu_only, random_inputs

pytestmark = cpu_only


def region(nbytes):
    """Host memory for the layer, 64-byte aligned and NaN-filled: (the array
    that keeps it alive, its address)."""
    raw = np.full(nbytes + 64, 0xFF, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw, raw.ctypes.data + start


def parts(part_bytes):
    """A region for each saved part: (the arrays, their addresses)."""
    made = [region(n) for n in part_bytes]
    return [raw for raw, _ in made], [at for _, at in made]


def owned_step(layer, y, schedule, inputs, dy):
    train = mf.CpuTrainingLayer(layer, [y], schedule, inputs["x"].shape[0])
    train.upload(inputs)
    train.upload_upstream_gradient(dy)
    train.forward()
    train.backward()
    return train.output(), {n: train.gradient(n) for n in ("x", "wr", "w1", "w2")}


@pytest.mark.parametrize("schedule_name", ["scattermoe", "default"])
def test_forwards_in_flight_each_backward_on_its_own_memory(schedule_name):
    layer, y, _ = build_moe_mlp()
    schedule = mf.default_schedule(layer, [y]) if schedule_name == "default" else mf.preset(schedule_name)
    caller = mf.CpuCallerTrainingLayer(layer, [y], schedule)
    steps = []
    for tokens, seed in ((37, 1), (130, 2), (1, 3)):
        inputs = random_inputs(tokens, seed=seed)
        dy = np.random.default_rng(seed + 10).uniform(-1, 1, (tokens, 64))
        caller.set_tokens(tokens)
        caller.upload(inputs)
        part_bytes, forward_ws, _ = caller.step_memory(tokens)
        saved, saved_at = parts(part_bytes)
        ws, ws_at = region(forward_ws)
        caller.forward(saved_at, ws_at)
        steps.append((tokens, inputs, dy, saved, saved_at, caller.output()))
    compiled_once = caller
    for tokens, inputs, dy, saved, saved_at, y_got in reversed(steps):
        caller.set_tokens(tokens)
        caller.upload(inputs)  # this forward's input and weights, as a framework binds them again
        caller.upload_upstream_gradient(dy)
        ws, ws_at = region(caller.step_memory(tokens)[2])
        caller.backward(saved_at, ws_at)
        y_want, grads_want = owned_step(layer, y, schedule, inputs, dy)
        np.testing.assert_array_equal(y_got, y_want)
        for name, want in grads_want.items():
            np.testing.assert_array_equal(caller.gradient(name), want, err_msg=f"{name} at {tokens} tokens")
    assert caller is compiled_once and caller.tokens == 37


def test_misuse_says_what_to_call():
    layer, y, _ = build_moe_mlp()
    caller = mf.CpuCallerTrainingLayer(layer, [y], mf.default_schedule(layer, [y]), 64)
    assert caller.written_over_saved, "the default's backward writes over what its forward saved"
    inputs = random_inputs(64, seed=5)
    caller.upload(inputs)
    caller.upload_upstream_gradient(np.ones((64, 64)))
    part_bytes, forward_ws, backward_ws = caller.step_memory(64)
    assert len(part_bytes) == 2, "the activations, then the small values and the routing tables"
    saved, saved_at = parts(part_bytes)
    ws, ws_at = region(max(forward_ws, backward_ws))
    with pytest.raises(mf.UserError, match="no forward at 64 tokens wrote its activations"):
        caller.backward(saved_at, ws_at)
    with pytest.raises(mf.UserError, match="saved part 0 must start at a 64-byte aligned"):
        caller.forward([saved_at[0] + 8, *saved_at[1:]], ws_at)
    with pytest.raises(mf.UserError, match="saved part 0 .* has no memory"):
        caller.forward([0, *saved_at[1:]], ws_at)
    with pytest.raises(mf.UserError, match=f"{len(saved_at) - 1} saved parts given; this layer's forward saves "
                                           f"{len(saved_at)}"):
        caller.forward(saved_at[1:], ws_at)
    caller.forward(saved_at, ws_at)
    caller.backward(saved_at, ws_at)
    with pytest.raises(mf.UserError, match="run the forward again"):
        caller.backward(saved_at, ws_at)
    with pytest.raises(mf.UserError, match="at least one token"):
        caller.set_tokens(0)
    with pytest.raises(mf.UserError, match="'x'.* 8 bytes at"):
        small = np.zeros(8, np.uint8)
        caller.bind("x", small.ctypes.data, 8)
    dtype, shape, contiguous, nbytes = caller.info("x")
    assert (dtype, shape, contiguous, nbytes) == ("bf16", (64, 64), True, 64 * 64 * 2)
