"""FP8 operands (Schedule.fp8) from Python: recorded in the schedule's text,
rounded by the reference when given the schedule, and by the CPU backend's
layer as the reference rounds them (bf16 storage: about 1e-2), while both
stay FP8's error (2^-4 a value) away from the unrounded reference."""

import numpy as np
import pytest

import moeforge as mf
from conftest import build_moe_mlp, cpu_only, normalized_error, random_inputs

TOKENS = 72


def test_the_choice_prints_replays_and_turns_off():
    s = mf.scattermoe().fp8("*").fp8("logits", None).fp8("o", "e5m2")
    text = str(s)
    assert 'fp8("*", "e4m3")' in text and 'fp8("logits", "off")' in text and 'fp8("o", "e5m2")' in text
    assert str(mf.Schedule.from_text(text)) == text
    with pytest.raises(mf.UserError, match=r"unknown FP8 format 'e3m3': use e4m3"):
        mf.scattermoe().fp8("h", "e3m3")


def test_the_reference_rounds_what_the_schedule_names():
    layer, _, _ = build_moe_mlp(d=192, f=160)
    inputs = random_inputs(TOKENS, d=192, f=160, seed=3)
    exact = mf.evaluate(layer, inputs)
    rounded = mf.evaluate(layer, inputs, schedule=mf.scattermoe().fp8("h").fp8("o"))
    # The router's product is not named: bit for bit.
    np.testing.assert_array_equal(rounded["logits"], exact["logits"])
    moved = normalized_error(rounded["h"], exact["h"])
    assert 1e-3 < moved < 0.1


@cpu_only
def test_the_cpu_layer_rounds_as_the_reference_does():
    layer, _, _ = build_moe_mlp(d=192, f=160)
    inputs = random_inputs(TOKENS, d=192, f=160, seed=4)
    schedule = mf.scattermoe().fp8("h").fp8("o")
    cpu = mf.CpuLayer(layer, schedule, TOKENS)
    cpu.upload(inputs)
    cpu.poison()
    cpu.run()
    to_fp8 = normalized_error(cpu.download("y"), mf.evaluate(layer, inputs, schedule=schedule)["y"])
    to_exact = normalized_error(cpu.download("y"), mf.evaluate(layer, inputs)["y"])
    assert to_fp8 < 1e-2
    assert to_exact > 3 * to_fp8
