"""moeforge.torch's forward alone (skipped without torch): under
torch.no_grad(), torch.inference_mode() or with nothing that needs a
gradient, the module runs the layer's forward program on caller memory
(mf.CpuCallerLayer / mf.CudaCallerLayer): nothing kept for a backward, any
token count through one compiled program, the output against plain PyTorch
on the module's own routing, and the training layer unaffected."""

import pytest

import moeforge as mf

torch = pytest.importorskip("torch")

import moeforge.torch as mft  # noqa: E402
from test_torch import DEVICES, D, E, F, K, normalized_error, torch_moe_mlp  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_any_token_count_through_one_forward_program(device, mode):
    torch.manual_seed(9)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device, keep_routing=True)
    params = [getattr(moe, n) for n in ("wr", "w1", "w2")]
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    compiled = None
    for tokens in (0, 1, 2, 3, 7, 64, 255, 4096):
        x = torch.randn(tokens, D, device=device, dtype=torch.bfloat16)
        with context():
            y = moe(x)
        assert y.shape == (tokens, D) and y.dtype == torch.bfloat16 and not y.requires_grad
        if tokens == 0:
            continue
        if compiled is None:
            compiled = moe._forward_only.layer
        assert moe._forward_only.layer is compiled, "a new token count compiled a new layer"
        want = torch_moe_mlp(x, *params, moe.routed_experts(tokens))
        assert normalized_error(y, want) < 2e-2, f"y at {tokens} tokens"
    # No training program was made: nothing was kept for a backward.
    assert moe._caller is None


@pytest.mark.parametrize("device", DEVICES)
def test_the_forward_alone_keeps_less_than_a_training_forward(device):
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device)
    x = torch.randn(300, D, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y_inference = moe(x)
    tables, _ = moe._forward_only.layer.step_memory(300)
    assert tables < moe.saved_bytes(300) / 4, "the forward alone holds its routing tables, no activations"
    # A frozen module (nothing requires a gradient) runs the forward alone too.
    for p in moe.parameters():
        p.requires_grad_(False)
    assert normalized_error(moe(x), y_inference) < 1e-6
    for p in moe.parameters():
        p.requires_grad_(True)
    # The training step beside it is unaffected: its y agrees to rounding
    # (another program, its own fusions) and its backward runs.
    xg = x.clone().requires_grad_(True)
    y = moe(xg)
    assert y.requires_grad and normalized_error(y, y_inference) < 1e-2
    y.float().sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_batch_and_sequence_under_inference_mode(device):
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device)
    x = torch.randn(3, 17, D, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = moe(x)
        flat = moe(x.reshape(-1, D))
    assert y.shape == (3, 17, D)
    assert torch.equal(y.reshape(-1, D), flat)


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_model_under_inference_mode(device):
    torch.manual_seed(10)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device)
    compiled = torch.compile(moe, fullgraph=True)
    with torch.inference_mode():
        for tokens in (5, 64, 9):
            x = torch.randn(tokens, D, device=device, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), moe(x)), f"{tokens} tokens"
    assert moe._caller is None


@pytest.mark.skipif(not torch.cuda.is_available() or not mf.gpu_available()[0], reason="no GPU")
def test_a_decoding_loop_replays_the_forward_as_one_graph():
    """At steady addresses (torch's allocator hands back the same blocks) the
    forward alone runs eagerly once, is captured once, then replays, each
    time on the values its input tensor holds then."""
    torch.manual_seed(13)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F)
    steps = 8
    # Every step's input and output made or kept in memory taken before the
    # loop: a tensor the loop allocates and keeps (a clone per step) would
    # move the blocks torch hands the next forward.
    inputs = torch.randn(steps, 4, D, device="cuda", dtype=torch.bfloat16)
    outputs = torch.full_like(inputs, float("nan"))  # poisoned: a step that writes nothing shows
    x = torch.empty(4, D, device="cuda", dtype=torch.bfloat16)
    for step in range(steps):
        x.copy_(inputs[step])
        with torch.inference_mode():
            y = moe(x)
        outputs[step].copy_(y)
        del y  # its block comes back to the next forward: the same addresses
    replayed, captured, eager = moe._forward_only.layer.graph_counts()
    assert captured >= 1 and replayed >= 2, (replayed, captured, eager)
    for step, (xi, yi) in enumerate(zip(inputs, outputs)):
        want = moe(xi.clone().requires_grad_(True)).detach()  # the training forward, eager kernels
        assert normalized_error(yi, want) < 1e-2, f"step {step}"


@pytest.mark.parametrize("device", DEVICES)
def test_each_token_bucket_runs_its_own_schedule(device, monkeypatch):
    """Under "auto" a bucket of token counts (powers of two, as `moeforge
    tune` keys its cache) runs the schedule found for it: decoding's few
    tokens and a prefill's many are compiled apart, once each, and every
    count of a bucket reuses its program. Here the schedule lookup is made
    to answer megablocks up to 4 tokens, the default past them."""
    torch.manual_seed(14)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device, keep_routing=True)
    params = [getattr(moe, n) for n in ("wr", "w1", "w2")]
    asked = []

    def schedule_for(tokens):
        asked.append(tokens)
        return mf.preset("megablocks") if tokens <= 4 else mf.default_schedule(moe.pipeline)

    monkeypatch.setattr(moe, "_forward_schedule", schedule_for)
    layers = {}
    for tokens in (1, 3, 37, 4, 300, 2, 64):
        x = torch.randn(tokens, D, device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            y = moe(x)
        layers.setdefault(tokens <= 4, moe._forward_only.layer)
        assert moe._forward_only.layer is layers[tokens <= 4], f"{tokens} tokens ran another bucket's program"
        want = torch_moe_mlp(x, *params, moe.routed_experts(tokens))
        assert normalized_error(y, want) < 2e-2, f"y at {tokens} tokens"
    assert layers[True] is not layers[False]
    assert len(moe._forward_runtimes) == 2
    # Buckets 1, 4 (3 and 4), 64 (37 and 64), 512 and 2: each looked up once.
    assert asked == [1, 3, 37, 300, 2]


@pytest.mark.skipif(not torch.cuda.is_available() or not mf.gpu_available()[0], reason="no GPU")
def test_the_forward_alone_is_captured_in_a_cuda_graph_per_token_bucket():
    """A server captures one CUDA graph per token bucket (here 1 and 64
    tokens) around the module under inference_mode and replays it on new
    inputs: each replay computes what an eager forward of the same input
    does (the same kernels; outputs poisoned before each replay)."""
    torch.manual_seed(15)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F)
    graphs = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for tokens in (1, 64):
        static_x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm-up outside the graph: the compile, the first binds
                moe(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            static_y = moe(static_x)
        graphs[tokens] = (graph, static_x, static_y)
    for step in range(3):
        for tokens, (graph, static_x, static_y) in graphs.items():
            x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
            static_x.copy_(x)
            with torch.inference_mode():  # an inference tensor is written inside the mode only
                static_y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            got = static_y.clone()
            with torch.inference_mode():
                want = moe(x)
            assert torch.isfinite(got.float()).all(), f"step {step}, {tokens} tokens: unwritten output"
            assert normalized_error(got, want) < 1e-5, f"step {step}, {tokens} tokens"
