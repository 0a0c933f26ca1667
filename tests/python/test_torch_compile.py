"""moeforge.torch under torch.compile (skipped without torch): the layer's
forward and backward are torch.library custom ops with fake kernels, so a
model holding a moeforge layer compiles with fullgraph=True (no graph break)
and computes what it computes eagerly, at every token count (dynamic shapes),
and the ops pass torch.library.opcheck."""

import pytest

torch = pytest.importorskip("torch")

import moeforge.torch as mft  # noqa: E402
from test_torch import DEVICES, needs_gpu  # noqa: E402


D = 64


class Block(torch.nn.Module):
    """A transformer block's MoE half: x + moe(norm(x)), on (batch, seq, d)."""

    def __init__(self, device):
        super().__init__()
        # No affine parameters: their gradients are bf16 sums over the
        # tokens, which inductor and eager PyTorch round differently.
        self.norm = torch.nn.LayerNorm(D, elementwise_affine=False, device=device, dtype=torch.bfloat16)
        self.moe = mft.example("swiglu_moe", experts=8, topk=2, d=D, f=128, device=device)

    def forward(self, x):
        return x + self.moe(self.norm(x))


def step(model, x, dy):
    """Output and every gradient (input's first) of one training step."""
    x = x.detach().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def check_same(what, got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        err = (g.float() - w.float()).abs().max().item()
        scale = w.float().abs().max().item()
        # Inductor fuses the LayerNorm's backward its own way: its rounding.
        assert err <= 1e-2 * max(scale, 1e-6), f"{what}, tensor {i}: max |compiled - eager| {err}, scale {scale}"


@pytest.mark.parametrize("device", DEVICES)
def test_a_model_compiles_whole_and_matches_eager(device):
    torch.manual_seed(3)
    model = Block(device)
    compiled = torch.compile(model, fullgraph=True)  # a graph break is an error
    for batch, seq in ((4, 37), (2, 50), (3, 11)):  # the second and third trace the token count as symbolic
        x = torch.randn(batch, seq, D, device=device, dtype=torch.bfloat16)
        dy = torch.randn(batch, seq, D, device=device, dtype=torch.bfloat16)
        want = step(model, x, dy)
        got = step(compiled, x, dy)
        check_same(f"{batch} x {seq} tokens", got, want)
    # One compiled program served every count.
    assert model.moe._caller is not None


@pytest.mark.parametrize("device", DEVICES)
def test_a_handle_carries_the_build_it_was_made_by(device):
    """The ops' handle is a constant of the traced graph, and with it of
    the key inductor caches the compiled graph under on disk: a graph that
    an earlier build traced (its saved region sized as that build laid it
    out) is not reused by a later one, whose sizes it would assert."""
    import os
    import moeforge as mf

    moe = mft.example("swiglu_moe", experts=8, topk=2, d=D, f=128, device=device)
    twin = mft.example("swiglu_moe", experts=8, topk=2, d=D, f=128, device=device)
    stamp = os.stat(mf._core.__file__).st_mtime_ns % (1 << 40)
    assert moe._handle >> 20 == stamp and twin._handle >> 20 == stamp
    assert twin._handle != moe._handle


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["moe_mlp", "deepseek_moe"])  # deepseek_moe: a constant input (its expert bias)
def test_the_ops_pass_opcheck(device, name, monkeypatch):
    torch.manual_seed(4)
    moe = mft.example(name, experts=8, topk=2, d=D, f=128, device=device)
    # opcheck compares the ops' outputs bit for bit, the saved region too,
    # whose bytes between its tensors are otherwise left as allocated.
    monkeypatch.setattr(mft, "zero_saved", True)
    x = torch.randn(37, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    params = [getattr(moe, n) for n in moe._weight_names]
    consts = [getattr(moe, n) for n in moe._const_names]
    result = torch.library.opcheck(torch.ops.moeforge.layer_forward, (moe._handle, [x], params, consts))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["swiglu_moe", "deepseek_moe", "moa"])
def test_the_saved_parts_are_formulas_of_the_token_count(device, name):
    """The forward op's fake kernel sizes each saved part at a symbolic
    count from the layer's terms over the count (a size known before the op
    runs, so inductor neither splits the graph around it nor leaves it to
    the run): the same bytes as the layer lays out, at every count."""
    moe = mft.example(name, experts=8, topk=2, d=D, f=128, device=device)
    moe._runtime(37)
    terms = moe._caller.saved_terms()
    assert terms is not None and len(terms) == 2, "the activations, then the small values and the routing tables"
    for tokens in (1, 2, 37, 63, 64, 65, 300, 4097):
        assert [mft._size_at(t, tokens) for t in terms] == moe.saved_part_bytes(tokens), tokens


@needs_gpu
def test_reduce_overhead_replays_the_step_in_cuda_graphs():
    """mode="reduce-overhead": inductor's CUDA-graph trees record the
    compiled step (the moeforge ops' kernels queued into their capture) and
    replay it, at a static token count."""
    # Dynamo remembers, per function, the sizes that varied in earlier
    # compiles (another test's Block.forward at three counts) and would trace
    # this one with a symbolic count: the next test's case.
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = Block("cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(4, 64, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4, 64, D, device="cuda", dtype=torch.bfloat16)
    want = step(model, x, dy)
    for _ in range(4):  # warm-up, capture, replays
        got = [t.clone() for t in step(compiled, x, dy)]
        check_same("reduce-overhead", got, want)


@needs_gpu
def test_reduce_overhead_at_a_symbolic_token_count():
    """dynamic=True: the token count symbolic. With the saved region sized
    only when the op ran (an unbacked size), inductor split the graph around
    the op and its CUDA-graph trees refused the partitions' outputs ('These
    storage data ptrs are not allocated in pool'); sized by the layer's
    terms over the count, the step records and replays at each count."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    model = Block("cuda")
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=True)
    for seq in (64, 64, 64, 37):
        x = torch.randn(4, seq, D, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(4, seq, D, device="cuda", dtype=torch.bfloat16)
        want = step(model, x, dy)
        got = [t.clone() for t in step(compiled, x, dy)]
        check_same("reduce-overhead, symbolic count", got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_ops_pass_opcheck_with_two_token_inputs_and_params_inside_one_tensor(device, monkeypatch):
    """The given-routing layer of transformers' experts implementation: x and
    the routing scores as token inputs, w1 and w3 read inside one gate_up
    tensor (stored_in) whose gradient comes back whole."""
    import moeforge.transformers as mftf
    torch.manual_seed(8)
    moe = mft.MoELayer(mftf.given_routing_pipeline(D, 128, 8, 2), device=device, inputs=["x", "scores"],
                       stored_in=mftf.gate_up_storage(128, D))
    monkeypatch.setattr(mft, "zero_saved", True)
    x = torch.randn(37, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    scores = torch.rand(37, 8, device=device, requires_grad=True)
    params = [getattr(moe, n) for n in moe._weight_names]
    result = torch.library.opcheck(torch.ops.moeforge.layer_forward, (moe._handle, [x, scores], params, []))
    assert set(result.values()) == {"SUCCESS"}, result
