"""moeforge: Mixture-of-Experts layers as algebra over tokens and experts,
computed under a schedule you choose, checked against an Eigen reference.

    import moeforge as mf
    T, D, F, E = mf.Dim.dynamic("T"), mf.Dim("D", 64), mf.Dim("F", 128), mf.Dim("E", 8)
    t, e, i, j = mf.Var("t", T), mf.Var("e", E), mf.Var("i", D), mf.Var("j", F)
    x = mf.Input("x", [T, D])
    wr, w1, w2 = mf.Param("wr", [D, E]), mf.Param("w1", [E, D, F]), mf.Param("w2", [E, F, D])
    logits, probs = mf.Func("logits", mf.f32), mf.Func("probs", mf.f32)
    logits[t, e] = mf.sum(i, x[t, i] * wr[i, e])
    probs[t, e] = mf.softmax(e, logits[t, e])
    route = mf.top_k(probs, e, 2)
    r = route.pair
    h, o, y = mf.Func("h"), mf.Func("o"), mf.Func("y")
    h[r, j] = mf.gelu(mf.sum(i, x[route.token(r), i] * w1[route.expert(r), i, j]))
    o[r, i] = mf.sum(j, h[r, j] * w2[route.expert(r), j, i])
    y[t, i] = mf.combine(route, t, route.gate(r) * o[r, i])
    layer = mf.Pipeline([y])

Then mf.evaluate(layer, inputs) (the reference), mf.CpuLayer(layer,
mf.scattermoe(), tokens) (the LLVM CPU backend), mf.CpuTrainingLayer for
forward and backward. Arrays go in as numpy arrays (or anything with
__dlpack__ in host memory) and come back as float64 numpy arrays. Mistakes
raise mf.UserError (a ValueError) with the message that says what to change.
"""

from ._core import *  # noqa: F401,F403
from ._core import UserError, __doc__ as _core_doc  # noqa: F401

__version__ = "0.11.0"
