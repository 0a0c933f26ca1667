"""moeforge.torch under FSDP2 (torch.distributed.fsdp.fully_shard; skipped
without torch): a model whose moeforge layer and the model around it are
sharded, and a transformers model whose experts are moeforge's, train with
the gradients of the same model unsharded. World size 1 (gloo on the CPU,
NCCL on a GPU), and two ranks in two processes (gloo on the CPU, NCCL where
the machine has two GPUs), each on its own tokens: the gradients averaged
over the ranks."""

import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import moeforge as mf  # noqa: E402
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


def _two_rank_step(rank, device, store, result):
    """One rank of the two-rank test: the sharded block's step on this
    rank's tokens; rank 0 writes the gathered gradients to `result`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2)
    try:
        torch.manual_seed(6)  # the same weights on both ranks
        sharded = Block(device)
        mesh = init_device_mesh(device, (2,))
        fully_shard(sharded.moe, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        torch.manual_seed(100 + rank)  # each rank's own tokens, another count on each
        x = torch.randn(37 + 26 * rank, D, device=device, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        sharded(x).backward(dy)
        grads = {name: p.grad.full_tensor().cpu() for name, p in sharded.named_parameters()}
        if rank == 0:
            torch.save(grads, result)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", [
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="two ranks on the GPU need two GPUs")),
    pytest.param("cpu", marks=pytest.mark.skipif(not mf.has_cpu_backend, reason="no CPU backend"))])
def test_two_ranks_average_the_gradients_of_their_own_tokens(device, tmp_path):
    """fully_shard over two ranks (two processes), each holding half of
    every weight and stepping on its own tokens: each gathered gradient is
    the mean of the unsharded block's gradients on the two ranks' tokens
    (FSDP's reduce-scatter), within bf16's rounding of that mean."""
    import torch.multiprocessing as mp

    result = os.path.join(tmp_path, "grads.pt")
    mp.spawn(_two_rank_step, args=(device, os.path.join(tmp_path, "store"), result), nprocs=2, join=True)
    got = torch.load(result)
    torch.manual_seed(6)
    plain = Block(device)
    per_rank = []
    for rank in range(2):
        torch.manual_seed(100 + rank)
        x = torch.randn(37 + 26 * rank, D, device=device, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        plain.zero_grad(set_to_none=True)
        plain(x).backward(dy)
        per_rank.append({name: p.grad.float().cpu() for name, p in plain.named_parameters()})
    assert set(got) == set(per_rank[0])
    for name, g in got.items():
        want = (per_rank[0][name] + per_rank[1][name]) / 2
        err = (g.float() - want).abs().max().item()
        scale = want.abs().max().item()
        assert scale > 0 and err <= 1e-2 * scale, f"{name}: max |sharded - mean| {err}, scale {scale}"
        # Not rank 0's own gradient alone: the other rank's tokens count.
        assert (g.float() - per_rank[0][name]).abs().max().item() > 1e-2 * scale, name
