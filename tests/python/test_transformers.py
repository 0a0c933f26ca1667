"""moeforge.transformers (skipped without torch or transformers): each of
transformers' sparse MoE blocks (Mixtral, Qwen3-MoE with and without
norm_topk_prob, OLMoE, DeepSeek-V3 with and without it) swapped for
moeforge's gives the block's output and every gradient, and small Qwen3-MoE
and DeepSeek-V3 models with their blocks swapped train as the originals
do."""

import copy

import pytest

import moeforge as mf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moeforge.transformers as mftf  # noqa: E402
from test_torch import DEVICES  # noqa: E402

D, F, E, K = 64, 128, 8, 2


def blocks():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    return {
        "mixtral": lambda: MixtralSparseMoeBlock(transformers.MixtralConfig(
            hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K, router_jitter_noise=0.0)),
        "qwen3moe": lambda: Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True)),
        "qwen3moe-unnormalised": lambda: Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)),
        "olmoe": lambda: OlmoeSparseMoeBlock(transformers.OlmoeConfig(
            hidden_size=D, intermediate_size=F, num_experts=E, num_experts_per_tok=K)),
    }


def error(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def bf16_exact_weights(block):
    """Random block weights that are bf16 values in f32: both sides read the same values."""
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p).mul(0.1).to(torch.bfloat16).float())


def check_against_block(block, ours, device):
    """One forward and backward of the transformers block (f32 from bf16
    inputs) and of its swapped copy (bf16): the output, the input gradient
    and every expert and router weight's gradient within bf16's spread."""
    x = torch.randn(3, 29, D, device=device).to(torch.bfloat16)
    dy = torch.randn(3, 29, D, device=device).to(torch.bfloat16)
    xr = x.float().requires_grad_(True)
    want = block(xr)
    want.backward(dy.float())
    xo = x.clone().requires_grad_(True)
    got = ours(xo)
    got.backward(dy)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert error(got, want) < 2e-2
    assert error(xo.grad, xr.grad) < 2e-2
    gate_up, down = block.experts.gate_up_proj.grad, block.experts.down_proj.grad
    assert error(ours.moe.gate_up_proj.grad[:, :F], gate_up[:, :F]) < 2e-2  # w1's
    assert error(ours.moe.gate_up_proj.grad[:, F:], gate_up[:, F:]) < 2e-2  # w3's
    assert error(ours.moe.w2.grad, down) < 2e-2
    assert error(ours.moe.wr.grad, block.gate.weight.grad) < 3e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe", "qwen3moe-unnormalised", "olmoe"])
def test_a_swapped_block_gives_the_blocks_output_and_gradients(device, kind):
    torch.manual_seed(21)
    block = blocks()[kind]().to(device)
    bf16_exact_weights(block)
    # A copy: the swapped block shares the router's and down_proj's
    # Parameters, whose gradients are compared below.
    ours = mftf.SparseMoeBlock.from_block(copy.deepcopy(block))
    assert ours.moe.wr.data_ptr() != block.gate.weight.data_ptr()
    check_against_block(block, ours, device)


def train_both(original, swapped, tokens, steps=20):
    """Each model trained `steps` AdamW steps on `tokens` (next-token loss):
    the two loss curves, after checking that they start together and that
    the swapped one falls."""
    losses = []
    for model in (original, swapped):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
        losses.append(curve)
    o, s = losses
    assert abs(s[0] - o[0]) < 1e-2 * o[0], f"step 0: {s[0]} against {o[0]}"
    assert s[-1] < 0.8 * s[0], f"the swapped model's loss did not fall: {s}"
    return o, s


@pytest.mark.parametrize("device", DEVICES)
def test_a_small_qwen3_moe_model_trains_as_the_original(device):
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=D, intermediate_size=F, moe_intermediate_size=F, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=K,
        norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(22)
    original = transformers.Qwen3MoeForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    swapped = transformers.Qwen3MoeForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    swapped.load_state_dict(original.state_dict())
    mftf.swap_sparse_moe_blocks(swapped)
    assert sum(isinstance(m, mftf.SparseMoeBlock) for m in swapped.modules()) == 2
    o, s = train_both(original, swapped, torch.randint(0, 96, (4, 24), device=device))
    # bf16 models whose routers round differently drift apart a little.
    assert abs(s[-1] - o[-1]) < 5e-2 * o[-1], f"after 20 steps: {s[-1]} against {o[-1]}"


@pytest.mark.parametrize("device", DEVICES)
def test_the_router_and_expert_weights_are_the_blocks_own_parameters(device):
    block = blocks()["mixtral"]().to(device=device, dtype=torch.bfloat16)
    ours = mftf.SparseMoeBlock.from_block(block)
    assert ours.moe.wr is block.gate.weight and ours.moe.w2 is block.experts.down_proj
    assert ours.moe.gate_up_proj is block.experts.gate_up_proj


@pytest.mark.parametrize("device", DEVICES)
def test_a_mixtral_model_with_its_auxiliary_loss(device):
    """output_router_logits: the swapped blocks run the original router for
    the logits transformers records, so the model's loss includes its
    load-balancing term as the original's does, and its gradient reaches
    the router's (shared) weight."""
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=D, intermediate_size=F, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=K, router_jitter_noise=0.0,
        output_router_logits=True, router_aux_loss_coef=0.5, max_position_embeddings=64)
    torch.manual_seed(23)
    original = transformers.MixtralForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    swapped = copy.deepcopy(original)
    mftf.swap_sparse_moe_blocks(swapped)
    tokens = torch.randint(0, 96, (2, 16), device=device)
    want, got = original(input_ids=tokens, labels=tokens), swapped(input_ids=tokens, labels=tokens)
    assert got.aux_loss is not None and abs(got.aux_loss.item() - want.aux_loss.item()) < 1e-2 * want.aux_loss.item()
    assert abs(got.loss.item() - want.loss.item()) < 1e-2 * want.loss.item()
    got.loss.backward()
    router = swapped.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def deepseek_v3_block(normalize=True):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    return DeepseekV3MoE(transformers.DeepseekV3Config(
        hidden_size=D, intermediate_size=2 * F, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K,
        n_group=4, topk_group=2, norm_topk_prob=normalize, routed_scaling_factor=2.5, n_shared_experts=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalize", [True, False])
def test_a_swapped_deepseek_v3_block_gives_the_blocks_output_and_gradients(device, normalize):
    """Sigmoid scores, the selection-only bias (non-zero, so that it moves
    the choice), groups, the scaled gates and the shared experts."""
    torch.manual_seed(24)
    block = deepseek_v3_block(normalize).to(device)
    bf16_exact_weights(block)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(E, device=device) * 0.3)
    ours = mftf.BiasedMoeBlock.from_block(copy.deepcopy(block))
    assert ours.moe.bias is not block.gate.e_score_correction_bias  # a copy's own buffer
    ours.shared_experts.to(torch.bfloat16)  # torch's MLP, in the model's dtype as in a bf16 model
    check_against_block(block, ours, device)
    assert error(ours.shared_experts.gate_proj.weight.grad, block.shared_experts.gate_proj.weight.grad) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_the_deepseek_v3_bias_is_the_blocks_buffer_and_steers_the_choice(device):
    """An update of the block's e_score_correction_bias (as a load-balancing
    loop makes between steps) reaches the swapped layer: a large bias on
    one expert sends every token there."""
    block = deepseek_v3_block().to(device=device, dtype=torch.bfloat16)
    ours = mftf.BiasedMoeBlock.from_block(block)
    assert ours.moe.bias is block.gate.e_score_correction_bias
    assert ours.moe.wr is block.gate.weight and ours.shared_experts is block.shared_experts
    ours.moe.keep_routing = True
    x = torch.randn(1, 40, D, device=device).to(torch.bfloat16)
    with torch.no_grad():
        block.gate.e_score_correction_bias.zero_()
        block.gate.e_score_correction_bias[5] = 100.0
        ours(x)
    experts = ours.moe.routed_experts(40).view(40, K)
    assert (experts == 5).any(dim=1).all()


@pytest.mark.parametrize("device", DEVICES)
def test_a_small_deepseek_v3_model_trains_as_the_original(device):
    config = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=D, intermediate_size=2 * F, moe_intermediate_size=F, num_hidden_layers=2,
        first_k_dense_replace=0, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=E, num_experts_per_tok=K,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=64)
    torch.manual_seed(25)
    original = transformers.DeepseekV3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    swapped = copy.deepcopy(original)
    mftf.swap_sparse_moe_blocks(swapped)
    assert sum(isinstance(m, mftf.BiasedMoeBlock) for m in swapped.modules()) == 2
    o, s = train_both(original, swapped, torch.randint(0, 96, (4, 24), device=device))
    assert abs(s[-1] - o[-1]) < 5e-2 * o[-1], f"after 20 steps: {s[-1]} against {o[-1]}"


def test_a_model_without_sparse_blocks_is_told_so():
    with pytest.raises(mf.UserError, match="has no sparse MoE block"):
        mftf.swap_sparse_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


# ---------------------------------------------------------------- the experts implementation


def experts_of(kind, device):
    """A transformers experts module (run eagerly, f32, bf16-exact weights)."""
    block = blocks()[kind]()
    block.experts.config._experts_implementation = "eager"
    bf16_exact_weights(block)
    return block.experts.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe", "olmoe"])
def test_the_experts_implementation_gives_the_experts_output_and_gradients(device, kind):
    """moeforge's experts call on the router's top_k_index and top_k_weights
    against the experts' eager loop (f32): the output and the gradients of
    the input, the routing weights, gate_up_proj and down_proj."""
    torch.manual_seed(31)
    experts = experts_of(kind, device)
    ours = copy.deepcopy(experts).to(torch.bfloat16)
    T = 37
    x = torch.randn(T, D, device=device).to(torch.bfloat16)
    weights, index = torch.topk(torch.randn(T, E, device=device).softmax(-1), K, dim=-1)
    dy = torch.randn(T, D, device=device).to(torch.bfloat16)
    xr, wr = x.float().requires_grad_(True), weights.clone().requires_grad_(True)
    want = experts(xr, index, wr)
    want.backward(dy.float())
    xo, wo = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    got = mftf.experts_forward(ours, xo, index, wo)
    got.backward(dy)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert error(got, want) < 2e-2
    assert error(xo.grad, xr.grad) < 2e-2
    assert error(wo.grad, wr.grad) < 2e-2
    assert error(ours.gate_up_proj.grad, experts.gate_up_proj.grad) < 2e-2
    assert error(ours.down_proj.grad, experts.down_proj.grad) < 2e-2
    # The experts hold no copy of their weights: only the module's own.
    assert [n for n, _ in ours.named_parameters()] == ["gate_up_proj", "down_proj"]


def small_model(kind, device):
    """A 2-layer bf16 model of transformers' `kind` whose experts
    transformers dispatches (ExpertsInterface)."""
    shared = dict(vocab_size=96, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, num_experts_per_tok=K)
    if kind == "qwen3moe":
        config = transformers.Qwen3MoeConfig(**shared, intermediate_size=F, moe_intermediate_size=F,
                                             num_key_value_heads=2, head_dim=16, num_experts=E, norm_topk_prob=True)
        return transformers.Qwen3MoeForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**shared, intermediate_size=F, num_key_value_heads=2, head_dim=16,
                                            num_local_experts=E, router_jitter_noise=0.0)
        return transformers.MixtralForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    config = transformers.DeepseekV3Config(
        **shared, intermediate_size=2 * F, moe_intermediate_size=F, first_k_dense_replace=0, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=E, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)
    return transformers.DeepseekV3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral", "deepseek_v3"])
def test_a_model_with_moeforge_experts_trains_as_the_original(device, kind):
    """set_experts_implementation("moeforge") on a small model: transformers'
    own router and blocks, moeforge's experts; its loss curve against the
    same model's with transformers' own experts implementation (grouped_mm
    where it dispatches, else eager)."""
    torch.manual_seed(32)
    original = small_model(kind, device)
    ours = copy.deepcopy(original)
    ours.set_experts_implementation("moeforge")
    assert ours.config._experts_implementation == "moeforge"
    o, s = train_both(original, ours, torch.randint(0, 96, (4, 24), device=device))
    assert abs(s[-1] - o[-1]) < 5e-2 * o[-1], f"after 20 steps: {s[-1]} against {o[-1]}"
    # Both layers' experts ran as moeforge layers.
    assert sum(m in mftf._EXPERTS_LAYERS for m in ours.modules()) == 2


def test_experts_it_does_not_read_are_named():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    experts = GptOssExperts(transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E))
    x = torch.randn(5, D)
    with pytest.raises(mf.UserError, match=r"GptOssExperts has has_bias=True, is_transposed=True, "
                                           r"is_concatenated=False: moeforge's experts implementation reads"):
        mftf.experts_forward(experts, x, torch.zeros(5, K, dtype=torch.long), torch.ones(5, K))


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_with_moeforge_experts_compiles_whole(device):
    """torch.compile(fullgraph=True) of a model whose experts are moeforge's:
    the experts' calls trace into the custom ops once prepare_experts made
    their layers (before that, tracing says what to call); its loss is the
    eager model's at two token counts (dynamic shapes) and the expert
    weights get gradients."""
    torch.manual_seed(33)
    model = small_model("qwen3moe", device)
    model.set_experts_implementation("moeforge")
    eager = copy.deepcopy(model)
    with pytest.raises(Exception, match=r"moeforge's experts layer is made outside torch.compile: call "
                                        r"moeforge.transformers.prepare_experts\(model\)"):
        torch.compile(copy.deepcopy(model), fullgraph=True, dynamic=True)(input_ids=torch.zeros(1, 4, dtype=torch.long,
                                                                                               device=device))
    compiled = torch.compile(mftf.prepare_experts(model), fullgraph=True, dynamic=True)
    for seq in (16, 9):
        tokens = torch.randint(0, 96, (2, seq), device=device)
        loss = compiled(input_ids=tokens, labels=tokens).loss
        want = eager(input_ids=tokens, labels=tokens).loss
        assert abs(loss.item() - want.item()) < 1e-2 * want.item()
        loss.backward()
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert len(experts) == 2 and all(m.gate_up_proj.grad is not None and m.down_proj.grad is not None
                                     for m in experts)
