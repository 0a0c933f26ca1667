"""Choices a layer does not take are said, not dropped: mf.not_applied for
the forward and the training step, and moeforge.torch.MoELayer's warning
(skipped without torch or the CPU backend)."""

import pytest

import moeforge as mf
from conftest import moe_mlp_parts


def test_not_applied_names_idle_layer_choices():
    parts = moe_mlp_parts()
    layer = mf.Pipeline([parts.y])
    blocked = mf.megablocks().padded_elementwise(True)
    assert mf.not_applied(layer, blocked) == [
        "padded_elementwise(true) is not applied: it changes nothing in this layer's program: the blocked "
        "permutation keeps every per-pair tensor in the padded order already"]
    # Scattered rows take it; GeLU's input gradient has nothing to chain.
    scattered = mf.scattermoe().padded_elementwise(True).chain_summed_gemms(True)
    assert mf.not_applied(layer, scattered) == []
    notes = mf.not_applied(layer, scattered, [parts.y])
    assert len(notes) == 1 and notes[0].startswith("chain_summed_gemms(true) is not applied: ")


def test_not_applied_names_a_funcs_choice_its_gemm_cannot_take():
    parts = moe_mlp_parts()
    s = mf.scattermoe().tma_store("h", True).tma("h", False)
    notes = mf.not_applied(mf.Pipeline([parts.y]), s)
    assert len(notes) == 1 and notes[0].startswith("definition 'h': tma_store(\"h\", true) is not applied: ")


def test_the_narrow_tail_is_taken_where_the_last_column_tile_is_half_full_and_named_elsewhere():
    # f = 320 under 256-wide tiles: the last column tile of d_h holds 64
    # columns; h has two B operands, whose wgmmas run as one.
    ex, _ = mf.make_example("swiglu_moe", tokens=64, experts=8, topk=2, d=256, f=320)
    outputs = list(ex.pipeline.outputs)
    s = mf.default_schedule(ex.pipeline, outputs).narrow_tail("d_h").narrow_tail("h")
    assert 'narrow_tail("d_h", true)' in s.to_text()
    assert mf.Schedule.from_text(s.to_text()).to_text() == s.to_text()
    notes = mf.not_applied(ex.pipeline, s, outputs)
    assert notes == ["definition 'h': narrow_tail(\"h\", true) is not applied: it has 2 B operands, whose wgmmas "
                     "run as one"]


def test_moelayer_warns_of_each_choice_it_does_not_take():
    torch = pytest.importorskip("torch")
    if mf.has_cuda_backend and mf.gpu_available()[0] and torch.cuda.is_available():
        device = "cuda"
    elif mf.has_cpu_backend:
        device = "cpu"
    else:
        pytest.skip("neither a GPU nor the CPU backend")
    import moeforge.torch as mft

    # A module trains: its notes are the training step's (GeLU's input
    # gradient is one GEMM, nothing to chain).
    parts = moe_mlp_parts()
    with pytest.warns(UserWarning, match=r"moeforge: chain_summed_gemms\(true\) is not applied"):
        mft.MoELayer(mf.Pipeline([parts.y]), schedule=mf.scattermoe().chain_summed_gemms(True), device=device)


def test_fused_attention_is_taken_by_an_attention_and_named_where_none_fuses():
    ex, _ = mf.make_example("attention", tokens=37)
    s = mf.default_schedule(ex.pipeline).fused_attention()
    assert "fused_attention(true)" in s.to_text()
    assert mf.Schedule.from_text(s.to_text()).to_text() == s.to_text()
    assert mf.not_applied(ex.pipeline, s) == []
    mlp = mf.Pipeline([moe_mlp_parts().y])
    notes = mf.not_applied(mlp, mf.scattermoe().fused_attention(True))
    assert notes == ["fused_attention(true) is not applied: this layer has no softmax over the tokens between two "
                     "contractions whose scores and probabilities nothing else reads (in training: nothing but the "
                     "backward's steps from them to the query's, key's and value's gradients)"]
