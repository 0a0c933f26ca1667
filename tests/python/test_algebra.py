"""The algebra from Python: layers build, print and refuse mistakes with the
C++ message (moeforge.UserError, a ValueError)."""

import numpy as np
import pytest

import moeforge as mf
from conftest import build_moe_mlp


def test_the_readme_layer_builds_and_prints_its_math():
    layer, y, route = build_moe_mlp()
    text = str(layer)
    assert "h(r, j) = gelu(sum(i, x(token(r), i) * w1(expert(r), i, j)))" in text
    assert "route = top_k(probs, e, k = 2)" in text
    assert "y(t, i) = combine(route, t, route_gate(r) * o(r, i))" in text
    assert [f.name for f in layer.outputs] == ["y"]
    assert layer.buffers == ["x", "wr", "w1", "w2"]
    assert route.k == 2 and route.name == "route"
    assert y.is_defined and y.dtype == mf.f32  # the f32 gate widens it


def test_dims_and_vars_say_what_they_are():
    T, D = mf.Dim.dynamic("T"), mf.Dim("D", 64)
    assert T.is_dynamic and T.extent is None
    assert not D.is_dynamic and D.extent == 64
    v = mf.Var("i", D)
    assert v.name == "i" and v.dim.name == "D"


def test_numbers_mix_with_expressions_on_either_side():
    D = mf.Dim("D", 4)
    i = mf.Var("i", D)
    a = mf.Input("a", [D], mf.f32)
    f = mf.Func("f", mf.f32)
    f[i] = 2.0 * a[i] + 1.0 - a[i] / 3.0 + mf.relu(-a[i]) + 1.0 / (1.0 + mf.exp(a[i]))
    g = mf.Func("g", mf.f32)
    g[i] = mf.max(f[i], 0.5)
    assert "g(i) = max(f(i), 0.5)" in str(mf.Pipeline([g]))


def test_a_subscript_that_is_not_an_index_is_a_user_error():
    D = mf.Dim("D", 4)
    a = mf.Input("a", [D])
    with pytest.raises(mf.UserError, match="'a' is indexed by Vars"):
        a["i"]


def test_definitions_are_checked_with_the_cpp_messages():
    D, E = mf.Dim("D", 4), mf.Dim("E", 3)
    i, j = mf.Var("i", D), mf.Var("j", E)
    a, b = mf.Input("a", [D, D]), mf.Input("b", [D])
    f, g = mf.Func("f"), mf.Func("g")
    with pytest.raises(mf.UserError, match=r"'a' has 2 dimensions \(D, D\) but a\(i\) gives 1 index"):
        f[i] = a[i]
    with pytest.raises(mf.UserError, match="index 'j' ranges over E"):
        g[i] = b[j]


def test_user_error_is_a_value_error():
    assert issubclass(mf.UserError, ValueError)


def test_unknown_preset_names_the_presets():
    with pytest.raises(mf.UserError, match="megablocks"):
        mf.preset("nosuch")


def test_schedules_chain_and_round_trip_through_text():
    s = mf.scattermoe().tile("*", 128, 128, 64).stages("*", 3).recompute(True)
    again = mf.Schedule.from_text(s.to_text())
    assert again.to_text() == s.to_text()
    assert again.name == "scattermoe"
    with pytest.raises(mf.UserError, match="tile_m 100"):
        mf.Schedule().tile("*", 100, 128, 64)


def test_the_default_splits_the_backward_kernel_for_memory():
    # The SwiGLU layer's default makes the gated h that dW2 reads in a
    # kernel of its own (its backward peak holds one T k x f tensor fewer),
    # and the choice is a schedule call like any other.
    ex, _ = mf.make_example("swiglu_moe", tokens=1, experts=8, topk=2, d=64, f=128)
    s = mf.default_schedule(ex.pipeline, list(ex.pipeline.outputs))
    assert "split_pointwise_for_memory(true)" in s.to_text()
    off = mf.Schedule.from_text(s.to_text()).split_pointwise_for_memory(False)
    assert off.to_text().endswith("split_pointwise_for_memory(false)\n")
    assert mf.Schedule.from_text(off.to_text()).to_text() == off.to_text()


def test_grad_names_a_gradient_per_input_and_param():
    layer, y, _ = build_moe_mlp()
    g = mf.grad(layer, [y])
    assert g.seed == "d_y"
    assert set(g.of) >= {"w1", "w2", "wr", "x"}
    assert g["w1"].name == g.of["w1"].name


def test_group_limited_top_k_prints_and_checks_its_groups():
    T, E = mf.Dim.dynamic("T"), mf.Dim("E", 12)
    t, e = mf.Var("t", T), mf.Var("e", E)
    s = mf.Input("s", [T, E], mf.f32)
    p = mf.Func("p", mf.f32)
    p[t, e] = s[t, e]
    with pytest.raises(mf.UserError, match="groups = 5 must divide the 12 experts"):
        mf.top_k(p, e, 2, groups=5, top_groups=1)
    route = mf.top_k(p, e, 2, groups=4, top_groups=2)
    y = mf.Func("y", mf.f32)
    y[t] = mf.combine(route, t, route.gate(route.pair))
    assert "top_k(p, e, k = 2, groups = 4, top_groups = 2)" in str(mf.Pipeline([y]))


def test_the_permutation_and_the_main_loop_are_schedule_choices():
    s = mf.Schedule("mine").permutation(mf.Permutation.scattered).gate(mf.GateFusion.epilogue).block(64)
    s.tile("*", 64, 128, 64).mma("*", mf.MmaKind.wgmma_ws)
    with pytest.raises(mf.UserError, match=r"set the tile before mma"):
        mf.Schedule().mma("*", mf.MmaKind.wgmma)
    text = s.to_text()
    assert "permutation(scattered)" in text and "gate(epilogue)" in text and "block(64)" in text
    assert "mma(\"*\", wgmma_ws)" in text
    assert mf.Schedule.from_text(text).to_text() == text


def test_arguments_past_their_range_and_names_that_cannot_be_printed_are_user_errors():
    """Not nanobind's 'Invoked with types': the call, the value and its bound."""
    with pytest.raises(mf.UserError, match=r"Dim\('D', \.\.\.\): extent 1180591620717411303424 is beyond "
                                           r"9223372036854775807, the largest it takes"):
        mf.Dim("D", 2**70)
    with pytest.raises(mf.UserError, match=r"stages\(\"o\", \.\.\.\): stages 1099511627776 is beyond 2147483647"):
        mf.scattermoe().stages("o", 2**40)
    with pytest.raises(mf.UserError, match=r"tile\(\"o\", \.\.\.\): n 8589934592 is beyond 2147483647"):
        mf.scattermoe().tile("o", 128, 2**33, 64)
    with pytest.raises(mf.UserError, match=r"block\(\.\.\.\): rows must be an integer, got True"):
        mf.scattermoe().block(True)
    assert mf.Dim("D", np.int64(5)).extent == 5  # numpy's integers are integers
    with pytest.raises(mf.UserError, match=r"Dim\.dynamic\(\"D\"\) in Python"):
        mf.Dim("D", 0)
    with pytest.raises(mf.UserError, match=r"Dim\(''\): a Dim needs a name"):
        mf.Dim("", 4)
    with pytest.raises(mf.UserError, match=r"Dim\.dynamic\(''\): a Dim\.dynamic needs a name"):
        mf.Dim.dynamic("")
    with pytest.raises(mf.UserError, match=r"Func\('\*'\): '\*' names every Func in a schedule"):
        mf.Func("*")
    with pytest.raises(mf.UserError, match=r"Var name 'i j' holds a quote, a backslash, whitespace"):
        mf.Var("i j", mf.Dim("D", 4))
    with pytest.raises(mf.UserError, match=r"Input name 'a\"b' holds a quote"):
        mf.Input('a"b', [mf.Dim("D", 4)])
    # An empty text is refused as the CLI refuses an empty file.
    with pytest.raises(mf.UserError, match=r"<text>: the text holds no primitive"):
        mf.Schedule.from_text("")
    assert mf.Schedule.from_text(mf.scattermoe().to_text()).name == "scattermoe"


def test_two_dims_of_one_name_and_different_extents_are_refused():
    T, D, D2 = mf.Dim.dynamic("T"), mf.Dim("D", 64), mf.Dim("D", 128)
    t, i, j = mf.Var("t", T), mf.Var("i", D), mf.Var("j", D2)
    x, w = mf.Input("x", [T, D]), mf.Param("w", [D, D2])
    y = mf.Func("y")
    y[t, j] = mf.sum(i, x[t, i] * w[i, j])
    with pytest.raises(mf.UserError, match=r"two different Dims are named 'D' in this pipeline, of extents 64 and "
                                           r"128: give each Dim its own name"):
        mf.Pipeline([y])


def test_two_vars_of_one_name_over_different_dims_are_refused():
    T, D, F = mf.Dim.dynamic("T"), mf.Dim("D", 8), mf.Dim("F", 16)
    t, i, i_f = mf.Var("t", T), mf.Var("i", D), mf.Var("i", F)
    x, w = mf.Input("x", [T, D]), mf.Param("w", [D, F])
    y = mf.Func("y")
    y[t, i_f] = mf.sum(i, x[t, i] * w[i, i_f])  # would print sum(i, x(t, i) * w(i, i))
    with pytest.raises(mf.UserError, match=r"two Vars named 'i' range over different Dims \((D and F|F and D)\), "
                                           r"the second in 'y': give each Var its own name"):
        mf.Pipeline([y])


def test_hostile_schedule_files_and_sizes_are_refused_with_what_to_change(tmp_path):
    """The sweep's cases (#51) from Python: a file of NULs and a large sparse
    one refused at their first byte, a 1 MB text replayed at once, and a Dim
    too large for the machine named with what to lower."""
    import time
    with pytest.raises(mf.UserError, match=r"'/dev/zero': byte 0 is a NUL \(0x00\), so this is not a text file"):
        mf.Schedule.load("/dev/zero")
    sparse = tmp_path / "sparse.sched"
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)  # 2 GiB of holes: no disk used
    with pytest.raises(mf.UserError, match=r"byte 0 is a NUL"):
        mf.Schedule.load(str(sparse))
    text = mf.scattermoe().to_text() + 'stages("o", 4)\n' * 70000  # about 1 MB
    start = time.perf_counter()
    assert mf.Schedule.from_text(text).name == "scattermoe"
    assert time.perf_counter() - start < 10  # linear: ~0.1 s here; quadratic took minutes
    T, D = mf.Dim.dynamic("T"), mf.Dim("D", 2**40)
    t, i = mf.Var("t", T), mf.Var("i", D)
    x, y = mf.Input("x", [T, D]), mf.Func("y")
    y[t, i] = x[t, i] * 2.0
    if mf.has_cpu_backend:
        with pytest.raises(mf.UserError, match=r"needs 32768\.0 GiB of host memory, and .* GiB is available: lower "
                                               r"the token count or the layer's sizes"):
            mf.CpuLayer(mf.Pipeline([y]), mf.scattermoe(), 8)
