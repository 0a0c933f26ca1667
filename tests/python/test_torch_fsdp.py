"""moeforge.torch under FSDP2 (torch.distributed.fsdp.fully_shard; skipped
without torch): a model whose moeforge layer and the model around it are
sharded, and a transformers model whose experts are moeforge's, train with
the gradients of the same model unsharded. World size 1 (gloo on the CPU,
NCCL on a GPU); two ranks are not tested yet."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import moeforge.torch as mft  # noqa: E402
from test_torch import DEVICES  # noqa: E402

D = 64


def check_sharded_gradients(plain, sharded):
    """Every Parameter of `sharded` is a DTensor whose gathered gradient is
    bit for bit the unsharded model's."""
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        assert type(q).__name__ == "DTensor", f"{name} is not sharded"
        got = q.grad.full_tensor()
        assert torch.equal(got, p.grad), f"{name}: max diff {(got.float() - p.grad.float()).abs().max()}"


class Block(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.moe = mft.example("swiglu_moe", experts=8, topk=2, d=D, f=128, device=device)

    def forward(self, x):
        return x + self.moe(x)


@pytest.mark.parametrize("device", DEVICES)
def test_a_sharded_model_has_the_unsharded_gradients(device, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(6)
        plain, sharded = Block(device), Block(device)
        sharded.load_state_dict(plain.state_dict())
        mesh = init_device_mesh(device, (1,))
        fully_shard(sharded.moe, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        for tokens in (37, 100):  # two steps, two token counts
            x = torch.randn(tokens, D, device=device, dtype=torch.bfloat16)
            dy = torch.randn(tokens, D, device=device, dtype=torch.bfloat16)
            plain.zero_grad(set_to_none=True)
            sharded.zero_grad(set_to_none=True)
            y_plain, y_sharded = plain(x), sharded(x)
            y_plain.backward(dy)
            y_sharded.backward(dy)
            assert torch.equal(y_plain, y_sharded)
            check_sharded_gradients(plain, sharded)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_a_sharded_transformers_model_with_moeforge_experts_has_the_unsharded_gradients(device, tmp_path):
    """fully_shard over each decoder layer and the whole of a small
    Qwen3-MoE model whose experts are moeforge's (their gate_up_proj read in
    place, w1 and w3 its halves): the loss and every gradient equal the
    unsharded model's."""
    transformers = pytest.importorskip("transformers")
    import copy

    import moeforge.transformers  # noqa: F401  (registers the experts implementation)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        config = transformers.Qwen3MoeConfig(
            vocab_size=96, hidden_size=D, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=64)
        torch.manual_seed(7)
        plain = transformers.Qwen3MoeForCausalLM(config).to(device=device, dtype=torch.bfloat16)
        plain.set_experts_implementation("moeforge")
        sharded = copy.deepcopy(plain)
        mesh = init_device_mesh(device, (1,))
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        tokens = torch.randint(0, 96, (2, 19), device=device)
        want = plain(input_ids=tokens, labels=tokens).loss
        got = sharded(input_ids=tokens, labels=tokens).loss
        want.backward()
        got.backward()
        assert torch.equal(got, want)
        check_sharded_gradients(plain, sharded)
    finally:
        dist.destroy_process_group()
