"""moeforge.transformers: transformers' MoE models run by moeforge, two ways.

    import moeforge.transformers as mftf                 # registers "moeforge" as an experts implementation
    model.set_experts_implementation("moeforge")         # 1. transformers' router, moeforge's experts
    mftf.swap_sparse_moe_blocks(model)                   # 2. or each sparse block a moeforge layer, router too

1. The experts implementation (experts_forward, registered with
transformers' ExpertsInterface as "moeforge" when this module is imported).
transformers hands an experts module the router's top_k_index and
top_k_weights; moeforge's layer takes them as a given routing (the
algebra's given_routing_pipeline: scores [T, E] holding each token's
weights at its chosen experts) and runs SwiGLU experts on the module's own
gate_up_proj (its gate and up halves as views) and down_proj, with
gradients to the input, the routing weights and both weights. Any model
whose experts transformers dispatches this way (Mixtral, Qwen3-MoE, OLMoE,
DeepSeek-V3, GLM-4-MoE) runs so, its weights read and their gradients
written in place (no copies: w1 and w3 are Params stored inside
gate_up_proj, outer_stride 2 F d). Under torch.compile(model,
fullgraph=True) the experts' calls trace into moeforge's custom ops once
their layers exist: call prepare_experts(model) first (or run the model
once), since a layer is compiled C++ that tracing cannot make.

2. The swapped block:

Each sparse MoE block (MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock,
OlmoeSparseMoeBlock) becomes a SparseMoeBlock: the same layer written in
moeforge's algebra (softmax router in f32, top-k, the gates renormalised
over the chosen experts where the block does it, SwiGLU experts, the gated
combine) as a moeforge.torch.MoELayer. The router's weight [E, d], the
experts' gate_up_proj [E, 2F, d] and down_proj [E, d, F] are the block's
own Parameters, read in their layouts (the algebra says which index is
which; w1 and w3 are gate_up_proj's halves, Params stored inside it), so
nothing is copied. The model then
trains and runs with moeforge's kernels, under torch.compile too. Where the
model's config asks for router logits (output_router_logits, for the
auxiliary loss), the block runs its original router beside the layer so
that transformers records them; its weight is the layer's, so both losses'
gradients reach one Parameter. The router runs in f32 from bf16 inputs, so
a pair transformers' bf16 router logits would route the other way at a
near-tie may differ. Not covered: Mixtral's router jitter noise in
training, an activation other than SiLU.

DeepSeek-V3's MoE block (DeepseekV3MoE, and GLM-4-MoE's Glm4MoeMoE of the
same router) becomes a BiasedMoeBlock: its router in the algebra too
(sigmoid scores; a selection-only expert bias, the block's own
e_score_correction_bias buffer, read in place as the layer's constant
input; the experts of the topk_group best of n_group groups, a group
scored by the sum of its two largest biased scores; the chosen unbiased
scores normalised over the token's k where norm_topk_prob says, and
scaled by routed_scaling_factor), the routed experts run by moeforge and
the block's shared experts by torch, added as the block adds them.
"""

import weakref

import torch

import moeforge as mf
import moeforge.torch as mft

# Where w1 and w3 lie in transformers' gate_up_proj [E, 2F, d] (the gate
# half, then the up half), for MoELayer's stored_in.
def gate_up_storage(intermediate, hidden):
    return {"gate_up_proj": {"w1": 0, "w3": intermediate * hidden}}


# transformers' sparse block classes, by name (so that importing this module
# needs no transformers: a model is walked by its modules' class names).
BLOCK_CLASSES = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "OlmoeSparseMoeBlock")
# Blocks with DeepSeek-V3's router and shared experts.
BIASED_BLOCK_CLASSES = ("DeepseekV3MoE", "Glm4MoeMoE")


class _Layer:
    """The dims, indices and weights every block's algebra shares, in
    transformers' layouts, so that the block's own Parameters are read in
    place: x [T, d]; the router's weight wr [E, d]; w1 and w3 [E, F, d],
    gate_up_proj's two halves (Params stored inside it: each expert's rows
    2 F d elements after the last's; gate_up_storage says where); down_proj
    w2 [E, d, F]."""

    def __init__(self, hidden, intermediate, experts):
        T, D = mf.Dim.dynamic("T"), mf.Dim("D", hidden)
        F, E = mf.Dim("F", intermediate), mf.Dim("E", experts)
        self.T, self.E = T, E
        self.t, self.e, self.i, self.j = mf.Var("t", T), mf.Var("e", E), mf.Var("i", D), mf.Var("j", F)
        self.x = mf.Input("x", [T, D])
        stride = 2 * intermediate * hidden
        self.w1 = mf.Param("w1", [E, F, D], mf.bf16, outer_stride=stride)
        self.w3 = mf.Param("w3", [E, F, D], mf.bf16, outer_stride=stride)
        self.w2 = mf.Param("w2", [E, D, F])

    def logits(self):
        wr = mf.Param("wr", [self.E, self.i.dim])
        logits = mf.Func("logits", mf.f32)
        logits[self.t, self.e] = mf.sum(self.i, self.x[self.t, self.i] * wr[self.e, self.i])
        return logits

    def experts(self, route, gate):
        """y[t] = sum over t's pairs r of gate(r) * (silu(x W1) * (x W3)) W2,
        each pair through its expert's weights (gate: pair -> expression):
        the Pipeline."""
        x, i, j, t, r = self.x, self.i, self.j, self.t, route.pair
        h, o, y = mf.Func("h"), mf.Func("o"), mf.Func("y")
        e = route.expert(r)
        h[r, j] = (mf.silu(mf.sum(i, x[route.token(r), i] * self.w1[e, j, i])) *
                   mf.sum(i, x[route.token(r), i] * self.w3[e, j, i]))
        o[r, i] = mf.sum(j, h[r, j] * self.w2[route.expert(r), i, j])
        y[t, i] = mf.combine(route, t, gate(r) * o[r, i])
        return mf.Pipeline([y])


def sparse_moe_pipeline(hidden, intermediate, experts, top_k, renormalize):
    """The sparse block in the algebra: y[t] = sum over t's top-k experts e
    of gate(t, e) * (silu(x W1[e]) * (x W3[e])) W2[e], the gates the
    router's softmax probabilities (over the chosen ones where
    `renormalize`). Returns the Pipeline."""
    a = _Layer(hidden, intermediate, experts)
    logits, probs = a.logits(), mf.Func("probs", mf.f32)
    probs[a.t, a.e] = mf.softmax(a.e, logits[a.t, a.e])
    route = mf.top_k(probs, a.e, top_k, renormalize=renormalize)
    return a.experts(route, route.gate)


def given_routing_pipeline(hidden, intermediate, experts, top_k):
    """SwiGLU experts over a routing chosen outside the layer (transformers'
    experts implementations are handed the router's top_k_index and
    top_k_weights): y[t] = sum over t's k pairs of their weight times the
    expert's output. The routing comes as scores [T, E] (f32): each token's
    k chosen experts hold their weights, every other expert a score below
    any weight; the layer's top-k picks the chosen and gates each pair by
    its score, so the weights' gradient is the scores' at the chosen.
    w1, w3 in gate_up_proj's halves' layout [E, F, d]. Returns the
    Pipeline."""
    a = _Layer(hidden, intermediate, experts)
    scores, choice = mf.Input("scores", [a.T, a.E], mf.f32), mf.Func("choice", mf.f32)
    choice[a.t, a.e] = scores[a.t, a.e]
    route = mf.top_k(choice, a.e, top_k)
    return a.experts(route, route.gate)


def biased_moe_pipeline(hidden, intermediate, experts, top_k, groups, top_groups, normalize, scaling):
    """DeepSeek-V3's routed experts in the algebra: scores s = sigmoid(x Wr^T),
    the top-k of s + bias among the experts of the top_groups best of
    `groups` groups (a group scored by its two largest), gates the chosen
    s (over their sum + 1e-20 where `normalize`) times `scaling`, SwiGLU
    experts, the gated combine. Returns the Pipeline."""
    a = _Layer(hidden, intermediate, experts)
    t, e = a.t, a.e
    # The bias moves the choice only: an Input (the block's buffer), no gradient.
    bias = mf.Input("bias", [a.E], mf.f32)
    logits, scores, choice = a.logits(), mf.Func("scores", mf.f32), mf.Func("choice", mf.f32)
    scores[t, e] = mf.sigmoid(logits[t, e])
    choice[t, e] = scores[t, e] + bias[e]
    route = mf.top_k(choice, e, top_k, groups=groups, top_groups=top_groups)
    r = route.pair
    picked, gate = mf.Func("picked", mf.f32), mf.Func("gate", mf.f32)
    picked[r] = scores[route.token(r), route.expert(r)]
    if normalize:
        total = mf.Func("picked_sum", mf.f32)
        total[t] = mf.combine(route, t, picked[r])
        gate[r] = picked[r] / (total[route.token(r)] + 1e-20) * scaling
    else:
        gate[r] = picked[r] * scaling
    return a.experts(route, lambda pair: gate[pair])


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


def _take_weights(moe, block):
    """The block's router weight, gate_up_proj (w1 and w3 in place) and
    down_proj become the layer's own Parameters: nothing is copied."""
    moe.wr = block.gate.weight
    moe.gate_up_proj = block.experts.gate_up_proj
    moe.w2 = block.experts.down_proj


class SparseMoeBlock(torch.nn.Module):
    """A transformers sparse MoE block run by moeforge: forward(hidden_states)
    takes (batch, seq, hidden) and returns the same shape and dtype."""

    def __init__(self, hidden, intermediate, experts, top_k, renormalize, schedule="auto", device="cuda"):
        super().__init__()
        self.pipeline = sparse_moe_pipeline(hidden, intermediate, experts, top_k, renormalize)
        self.moe = mft.MoELayer(self.pipeline, schedule=schedule, device=device,
                                stored_in=gate_up_storage(intermediate, hidden))
        self.gate = None  # the original router, run only for the logits transformers records
        self.record_router_logits = False

    @classmethod
    def from_block(cls, block, schedule="auto", record_router_logits=False):
        """The moeforge block of a transformers one (on the block's device,
        'cuda' or 'cpu'): its router, gate_up_proj and down_proj Parameters
        shared; the original router kept for `record_router_logits`."""
        shape = _block_shape(block)
        new = cls(*shape, schedule=schedule, device=block.experts.gate_up_proj.device.type)
        _take_weights(new.moe, block)
        new.gate = block.gate
        new.record_router_logits = record_router_logits
        return new

    def forward(self, hidden_states):
        if self.record_router_logits and self.gate is not None:
            self.gate(hidden_states.reshape(-1, hidden_states.shape[-1]))  # transformers' hooks record its logits
        y = self.moe(hidden_states)
        return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)


def _biased_block_shape(block):
    """(hidden, intermediate, experts, top_k, groups, top_groups, normalize,
    scaling) of a DeepSeek-V3-style block, or a UserError saying what it
    lacks."""
    name = type(block).__name__
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    if (experts is None or gate is None or not hasattr(experts, "gate_up_proj")
            or not hasattr(gate, "e_score_correction_bias") or getattr(block, "shared_experts", None) is None):
        raise mf.UserError(f"{name} has no experts.gate_up_proj, gate.e_score_correction_bias and shared_experts: "
                           f"moeforge.transformers reads transformers 5's {', '.join(BIASED_BLOCK_CLASSES)}")
    act = type(experts.act_fn).__name__
    if "SiLU" not in act:
        raise mf.UserError(f"{name}'s experts use {act}: moeforge.transformers writes SwiGLU (SiLU) experts")
    groups, top_groups = int(gate.num_group), int(gate.topk_group)
    if groups < 1 or experts.num_experts % groups or experts.num_experts // groups < 2:
        raise mf.UserError(f"{name}: n_group = {groups} must split the {experts.num_experts} experts into groups of "
                           "at least two (a group is scored by its two largest scores)")
    return (experts.hidden_dim, experts.intermediate_dim, experts.num_experts, gate.top_k, groups, top_groups,
            bool(gate.norm_topk_prob), float(gate.routed_scaling_factor))


class BiasedMoeBlock(torch.nn.Module):
    """A DeepSeek-V3-style MoE block run by moeforge (the router and the
    routed experts; the shared experts by torch): forward(hidden_states)
    takes (batch, seq, hidden) and returns the same shape and dtype."""

    def __init__(self, hidden, intermediate, experts, top_k, groups, top_groups, normalize, scaling,
                 schedule="auto", device="cuda"):
        super().__init__()
        self.pipeline = biased_moe_pipeline(hidden, intermediate, experts, top_k, groups, top_groups, normalize,
                                            scaling)
        self.moe = mft.MoELayer(self.pipeline, schedule=schedule, device=device,
                                stored_in=gate_up_storage(intermediate, hidden))
        self.shared_experts = None  # the block's own, set by from_block

    @classmethod
    def from_block(cls, block, schedule="auto"):
        """The moeforge block of a transformers one (on the block's device):
        its router weight, gate_up_proj, down_proj, expert bias (the buffer
        itself, so an update of it reaches the layer) and shared experts
        shared."""
        shape = _biased_block_shape(block)
        new = cls(*shape, schedule=schedule, device=block.experts.gate_up_proj.device.type)
        _take_weights(new.moe, block)
        new.moe.bias = block.gate.e_score_correction_bias
        new.shared_experts = block.shared_experts
        return new

    def forward(self, hidden_states):
        y = self.moe(hidden_states)
        y = y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)
        return y + self.shared_experts(hidden_states)


def swap_sparse_moe_blocks(model, schedule="auto"):
    """Replaces every transformers sparse MoE block in `model` by a
    SparseMoeBlock (a BiasedMoeBlock for DeepSeek-V3's and GLM-4-MoE's) with
    its weights (in place; returns the model), recording router logits
    where the model's config asks for them. A UserError when the model has
    none."""
    kinds = BLOCK_CLASSES + BIASED_BLOCK_CLASSES
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child).__name__ in kinds]
    if not swaps:
        raise mf.UserError(f"{type(model).__name__} has no sparse MoE block moeforge.transformers reads "
                           f"({', '.join(kinds)})")
    record = bool(getattr(getattr(model, "config", None), "output_router_logits", False))
    for parent, name, child in swaps:
        if type(child).__name__ in BIASED_BLOCK_CLASSES:
            setattr(parent, name, BiasedMoeBlock.from_block(child, schedule=schedule))
        else:
            setattr(parent, name, SparseMoeBlock.from_block(child, schedule=schedule, record_router_logits=record))
    return model


# ---------------------------------------------------------------- the experts implementation

# A score below any routing weight: the experts a token did not choose. Finite,
# because the layer's top-k reports an infinite score as bad input.
_UNCHOSEN = torch.finfo(torch.float32).min

# Each transformers experts module's moeforge layers, by (device, top_k): made
# at its first call, dropped with the module.
_EXPERTS_LAYERS = weakref.WeakKeyDictionary()


def _experts_shape(experts):
    """(hidden, intermediate, experts) of a transformers experts module, or a
    UserError naming what moeforge's experts implementation does not read."""
    name = type(experts).__name__
    if not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
        raise mf.UserError(f"{name} has no gate_up_proj and down_proj: moeforge's experts implementation reads "
                           "transformers 5's fused expert weights")
    unread = [flag for flag, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False),
                                      ("is_concatenated", True), ("_is_expert_parallel", False))
              if getattr(experts, flag, want) != want]
    if unread:
        raise mf.UserError(f"{name} has {', '.join(f'{f}={getattr(experts, f)}' for f in unread)}: moeforge's "
                           "experts implementation reads gate_up_proj [E, 2F, d] as [gate; up] halves, down_proj "
                           "[E, d, F], no biases, on one device")
    act = type(getattr(experts, "act_fn", None)).__name__
    if "SiLU" not in act:
        raise mf.UserError(f"{name}'s experts use {act}: moeforge's experts implementation writes SwiGLU (SiLU)")
    return experts.hidden_dim, experts.intermediate_dim, experts.num_experts


def _experts_layer(experts, device, top_k):
    layers = _EXPERTS_LAYERS.setdefault(experts, {})
    key = (str(device), top_k)
    if key not in layers:
        if torch.compiler.is_compiling():
            # A layer is compiled C++ that torch.compile cannot trace into being.
            raise mf.UserError(f"{type(experts).__name__}: moeforge's experts layer is made outside torch.compile: "
                               "call moeforge.transformers.prepare_experts(model) (or run the model once) first")
        hidden, intermediate, count = _experts_shape(experts)
        layers[key] = mft.MoELayer(given_routing_pipeline(hidden, intermediate, count, top_k), device=device.type,
                                   own_params=False, inputs=["x", "scores"],
                                   stored_in=gate_up_storage(intermediate, hidden))
    return layers[key]


def experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """transformers' experts call, run by moeforge: hidden_states [T, d], the
    router's top_k_index and top_k_weights [T, k] -> [T, d] in
    hidden_states' dtype. The experts' gate_up_proj and down_proj are read
    where they are (w1 and w3 are gate_up_proj's halves, in place), and
    gradients reach them, hidden_states and top_k_weights."""
    top_k = top_k_index.shape[-1]
    layer = _experts_layer(experts, hidden_states.device, top_k)
    tokens, count = hidden_states.shape[0], experts.num_experts
    scores = torch.full((tokens, count), _UNCHOSEN, dtype=torch.float32, device=hidden_states.device)
    scores = scores.scatter(1, top_k_index.long(), top_k_weights.float())
    y = layer(hidden_states, scores, params={"gate_up_proj": experts.gate_up_proj, "w2": experts.down_proj})
    return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)


def prepare_experts(model):
    """Makes the moeforge layer of every experts module in `model` now (on
    its device, for its config's num_experts_per_tok), as its first call
    would: torch.compile(model, fullgraph=True) then traces the experts'
    calls without making anything. Returns the model."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and config is not None:
            top_k = getattr(config, "num_experts_per_tok", None)
            if top_k is not None:
                _experts_layer(module, module.gate_up_proj.device, int(top_k))
    return model


def register_experts_implementation(name="moeforge"):
    """Registers experts_forward with transformers' ExpertsInterface under
    `name`, so that a model whose experts transformers dispatches
    (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, ...) runs them with moeforge:
    `model.set_experts_implementation(name)` or
    `from_pretrained(..., experts_implementation=name)`. Importing this
    module registers "moeforge" where transformers is installed."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)


try:
    register_experts_implementation()
except ImportError:  # no transformers here: nothing to register with
    pass
