"""moeforge.transformers: transformers' sparse MoE blocks run by moeforge.

    import moeforge.transformers as mftf
    model = AutoModelForCausalLM.from_config(config)      # Mixtral, Qwen3-MoE or OLMoE
    swapped = mftf.swap_sparse_moe_blocks(model)          # each block now a moeforge layer

Each sparse MoE block (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock,
OlmoeSparseMoeBlock) becomes a SparseMoeBlock: the same layer written in
moeforge's algebra (softmax router in f32, top-k, the gates renormalised
over the chosen experts where the block does it, SwiGLU experts, the gated
combine) as a moeforge.torch.MoELayer, with the block's weights copied in
once, in the layouts the layer reads (gate_up_proj [E, 2F, d] split and
transposed into w1, w3 [E, d, F], down_proj [E, d, F] into w2 [E, F, d],
the router's weight [E, d] into wr [d, E]). The model then trains and runs
with moeforge's kernels, under torch.compile too; its state_dict holds the
new names and layouts. The router runs in f32 from bf16 inputs, so a pair
transformers' bf16 router logits would route the other way at a near-tie
may differ. Not covered: Mixtral's router jitter noise in training, the
router logits transformers records for its auxiliary loss
(output_router_logits), an activation other than SiLU.
"""

import torch

import moeforge as mf
import moeforge.torch as mft

# transformers' sparse block classes, by name (so that importing this module
# needs no transformers: a model is walked by its modules' class names).
BLOCK_CLASSES = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock")


def sparse_moe_pipeline(hidden, intermediate, experts, top_k, renormalize):
    """The sparse block in the algebra: y[t] = sum over t's top-k experts e
    of gate(t, e) * (silu(x W1[e]) * (x W3[e])) W2[e], the gates the
    router's softmax probabilities (over the chosen ones where
    `renormalize`). Returns the Pipeline."""
    T, D = mf.Dim.dynamic("T"), mf.Dim("D", hidden)
    F, E = mf.Dim("F", intermediate), mf.Dim("E", experts)
    t, e, i, j = mf.Var("t", T), mf.Var("e", E), mf.Var("i", D), mf.Var("j", F)
    x = mf.Input("x", [T, D])
    wr, w1 = mf.Param("wr", [D, E]), mf.Param("w1", [E, D, F])
    w3, w2 = mf.Param("w3", [E, D, F]), mf.Param("w2", [E, F, D])
    logits, probs = mf.Func("logits", mf.f32), mf.Func("probs", mf.f32)
    logits[t, e] = mf.sum(i, x[t, i] * wr[i, e])
    probs[t, e] = mf.softmax(e, logits[t, e])
    route = mf.top_k(probs, e, top_k, renormalize=renormalize)
    r = route.pair
    h, o, y = mf.Func("h"), mf.Func("o"), mf.Func("y")
    h[r, j] = (mf.silu(mf.sum(i, x[route.token(r), i] * w1[route.expert(r), i, j])) *
               mf.sum(i, x[route.token(r), i] * w3[route.expert(r), i, j]))
    o[r, i] = mf.sum(j, h[r, j] * w2[route.expert(r), j, i])
    y[t, i] = mf.combine(route, t, route.gate(r) * o[r, i])
    return mf.Pipeline([y])


def _block_shape(block):
    """(hidden, intermediate, experts, top_k, renormalize) of a transformers
    sparse block, or a UserError saying what it lacks."""
    name = type(block).__name__
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    if experts is None or gate is None or not hasattr(experts, "gate_up_proj"):
        raise mf.UserError(f"{name} has no experts.gate_up_proj and gate: moeforge.transformers reads transformers "
                           f"5's sparse blocks ({', '.join(BLOCK_CLASSES)})")
    act = type(experts.act_fn).__name__
    if "SiLU" not in act:
        raise mf.UserError(f"{name}'s experts use {act}: moeforge.transformers writes SwiGLU (SiLU) experts")
    if getattr(block, "jitter_noise", 0):
        raise mf.UserError(f"{name} has router jitter noise {block.jitter_noise}: not written in moeforge's "
                           "algebra; set router_jitter_noise=0 in the config")
    # Mixtral's router always renormalises the chosen probabilities; Qwen3-MoE's
    # and OLMoE's as their config's norm_topk_prob says.
    renormalize = bool(getattr(gate, "norm_topk_prob", True))
    return experts.hidden_dim, experts.intermediate_dim, experts.num_experts, gate.top_k, renormalize


class SparseMoeBlock(torch.nn.Module):
    """A transformers sparse MoE block run by moeforge: forward(hidden_states)
    takes (batch, seq, hidden) and returns the same shape and dtype."""

    def __init__(self, hidden, intermediate, experts, top_k, renormalize, schedule="auto", device="cuda"):
        super().__init__()
        self.pipeline = sparse_moe_pipeline(hidden, intermediate, experts, top_k, renormalize)
        self.moe = mft.MoELayer(self.pipeline, schedule=schedule, device=device)

    @classmethod
    def from_block(cls, block, schedule="auto"):
        """The moeforge block of a transformers one, its weights copied in
        (on the block's device; 'cuda' or 'cpu')."""
        shape = _block_shape(block)
        weight = block.experts.gate_up_proj
        new = cls(*shape, schedule=schedule, device=weight.device.type)
        _, f = shape[0], shape[1]
        with torch.no_grad():
            new.moe.wr.copy_(block.gate.weight.t())
            new.moe.w1.copy_(weight[:, :f, :].transpose(1, 2))
            new.moe.w3.copy_(weight[:, f:, :].transpose(1, 2))
            new.moe.w2.copy_(block.experts.down_proj.transpose(1, 2))
        return new

    def forward(self, hidden_states):
        y = self.moe(hidden_states)
        return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)


def swap_sparse_moe_blocks(model, schedule="auto"):
    """Replaces every transformers sparse MoE block in `model` by a
    SparseMoeBlock with its weights (in place; returns the model). A
    UserError when the model has none."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child).__name__ in BLOCK_CLASSES]
    if not swaps:
        raise mf.UserError(f"{type(model).__name__} has no sparse MoE block moeforge.transformers reads "
                           f"({', '.join(BLOCK_CLASSES)})")
    for parent, name, child in swaps:
        setattr(parent, name, SparseMoeBlock.from_block(child, schedule=schedule))
    return model
