"""moeforge.torch (skipped without torch; the GPU cases without a GPU, the
CPU ones without the CPU backend): the module's output and gradients against
a plain PyTorch implementation of the same layer with the same weights and
routing, a training loop whose loss falls, CUDA graph capture, and errors
for bad input."""

import math

import pytest

import moeforge as mf

torch = pytest.importorskip("torch")

import moeforge.torch as mft  # noqa: E402
from conftest import moe_mlp_parts  # noqa: E402

GPU = mf.has_cuda_backend and mf.gpu_available()[0] and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason=f"no GPU: {mf.gpu_available()[1] or 'torch sees none'}")
DEVICES = [pytest.param("cuda", marks=needs_gpu),
           pytest.param("cpu", marks=pytest.mark.skipif(not mf.has_cpu_backend, reason="no CPU backend"))]

D, F, E, K = 64, 128, 8, 2


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def torch_moe_mlp(x, wr, w1, w2, experts):
    """The moe_mlp example in plain PyTorch (f32 arithmetic on the same bf16
    values), routed to `experts` (pair order), so the comparison does not
    hinge on near-ties in the top-k."""
    xf, tokens = x.float(), x.shape[0]
    probs = torch.softmax(xf @ wr.float(), dim=1)
    chosen = experts.view(tokens, K).long().to(x.device)
    gate = probs.gather(1, chosen)
    y = torch.zeros(tokens, D, device=x.device)
    for slot in range(K):
        e = chosen[:, slot]
        h = gelu_tanh(torch.einsum("td,tdf->tf", xf, w1.float()[e]))
        y = y + gate[:, slot:slot + 1] * torch.einsum("tf,tfd->td", h, w2.float()[e])
    return y


def torch_swiglu_moe(x, wr, w1, w3, w2, experts):
    """The swiglu_moe example (Mixtral's layer: gates renormalised over the
    chosen experts, silu(x W1[e]) * (x W3[e]) W2[e]) in plain PyTorch."""
    xf, tokens = x.float(), x.shape[0]
    probs = torch.softmax(xf @ wr.float(), dim=1)
    chosen = experts.view(tokens, K).long().to(x.device)
    picked = probs.gather(1, chosen)
    gate = picked / picked.sum(dim=1, keepdim=True)
    y = torch.zeros(tokens, D, device=x.device)
    for slot in range(K):
        e = chosen[:, slot]
        h1 = torch.einsum("td,tdf->tf", xf, w1.float()[e])
        h3 = torch.einsum("td,tdf->tf", xf, w3.float()[e])
        a = torch.nn.functional.silu(h1) * h3
        y = y + gate[:, slot:slot + 1] * torch.einsum("tf,tfd->td", a, w2.float()[e])
    return y


def torch_moa(x, wr, wq, wk, wv, wo, experts):
    """The moa example (Mixture-of-Attention: each chosen head's own query and
    output projections around one attention over shared keys and values,
    every token attending to every token) in plain PyTorch."""
    xf, tokens = x.float(), x.shape[0]
    probs = torch.softmax(xf @ wr.float(), dim=1)
    chosen = experts.view(tokens, K).long().to(x.device)
    gate = probs.gather(1, chosen)
    key, value = xf @ wk.float(), xf @ wv.float()
    y = torch.zeros(tokens, D, device=x.device)
    for slot in range(K):
        e = chosen[:, slot]
        q = torch.einsum("td,tdf->tf", xf, wq.float()[e])
        z = torch.softmax(q @ key.T / math.sqrt(F), dim=1) @ value
        y = y + gate[:, slot:slot + 1] * torch.einsum("tf,tfd->td", z, wo.float()[e])
    return y


PLAIN = {  # example: (its plain PyTorch form, the parameters it takes after x, in order)
    "moe_mlp": (torch_moe_mlp, ("wr", "w1", "w2")),
    "swiglu_moe": (torch_swiglu_moe, ("wr", "w1", "w3", "w2")),
    "moa": (torch_moa, ("wr", "wq", "wk", "wv", "wo")),
}


def normalized_error(got, ref):
    got, ref = got.float(), ref.float()
    if torch.isnan(got).any():
        return math.inf
    return ((got - ref).abs().max() / ref.abs().max()).item()


def plain_step(plain, x, params, experts, dy):
    """y and every gradient (x's first, then the parameters' in order) of the
    plain PyTorch layer, in f32, on copies of x and params."""
    leaves = [t.detach().float().clone().requires_grad_(True) for t in [x, *params]]
    y = plain(*leaves, experts)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def rounding_spread(plain, x, params, experts, dy):
    """How far y and each gradient move when every input element moves by
    bf16's rounding (its largest relative error 2^-9, random sign; two
    draws, the larger move kept): the spread a correct bf16 computation can
    land in. With one token a router gradient is one small difference of
    larger terms (the renormalised gates' logits), so its error relative to
    itself says nothing about the layer; against this spread it does, and a
    real mistake (a missed term, a wrong sign) lands far outside it."""
    ref = plain_step(plain, x, params, experts, dy)
    spread = [0.0] * len(ref)
    for draw in (1, 2):
        g = torch.Generator(device=x.device).manual_seed(draw)

        def moved(t):
            sign = torch.randint(0, 2, t.shape, generator=g, device=t.device).float() * 2 - 1
            return t.detach().float() * (1 + sign * 2.0 ** -9)

        got = plain_step(plain, moved(x), [moved(p) for p in params], experts, dy)
        spread = [max(s, (a - b).abs().max().item()) for s, a, b in zip(spread, got, ref)]
    return spread


def check_close(what, got, ref, spread, tolerance=2e-2):
    """Within tolerance of ref's largest value, or, for a value that is a
    cancellation, within 4x the rounding spread (a backend rounds at several
    stages, each up to 2^-9)."""
    err = normalized_error(got, ref)
    if err < tolerance:
        return
    abs_err = (got.float() - ref.float()).abs().max().item()
    assert abs_err <= 4 * spread, f"{what}: error {err:.4f} of its scale, |error| {abs_err:.3g} > 4 x spread {spread:.3g}"


def test_the_comparison_still_catches_a_wrong_router_gradient():
    # One token of swiglu_moe in plain PyTorch on the CPU: the router's
    # gradient, a cancellation, passes at its own value and fails at a wrong
    # sign, a factor of 2 or zero, though its spread allows more than 2e-2
    # of its own scale.
    torch.manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(1, D, dtype=bf)
    params = [torch.randn(D, E, dtype=bf) * 0.1, torch.randn(E, D, F, dtype=bf) * 0.1,
              torch.randn(E, D, F, dtype=bf) * 0.1, torch.randn(E, F, D, dtype=bf) * 0.1]
    experts = torch.topk(x.float() @ params[0].float(), K, dim=1).indices.view(-1).int()
    dy = torch.randn(1, D)
    ref = plain_step(torch_swiglu_moe, x, params, experts, dy)
    spread = rounding_spread(torch_swiglu_moe, x, params, experts, dy)
    d_wr = ref[2]
    assert 0 < spread[2] < 0.1 * d_wr.abs().max().item()
    check_close("wr.grad", d_wr, d_wr, spread[2])
    for wrong in (-d_wr, 2 * d_wr, torch.zeros_like(d_wr)):
        with pytest.raises(AssertionError):
            check_close("wr.grad", wrong, d_wr, spread[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule", ["megablocks", "scattermoe"])
@pytest.mark.parametrize("tokens", [1, 200])
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_output_and_gradients_match_plain_pytorch(device, schedule, tokens, name):
    if name == "moa" and device == "cuda":
        pytest.skip("moa's attention has one column per token, and the CUDA backend's tiles need a static "
                    "column count (it says so when asked to compile moa)")
    torch.manual_seed(0)
    moe = mft.example(name, experts=E, topk=K, d=D, f=F, schedule=schedule, device=device, keep_routing=True)
    x = torch.randn(tokens, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = moe(x)
    assert y.shape == (tokens, D) and y.dtype == torch.float32
    dy = torch.randn_like(y)
    y.backward(dy)

    experts = moe.routed_experts(tokens)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in moe.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    plain, names = PLAIN[name]
    assert sorted(names) == sorted(params)
    yr = plain(xr, *(params[n] for n in names), experts)
    yr.backward(dy)
    spread = rounding_spread(plain, x, [params[n] for n in names], experts, dy)
    check_close("y", y, yr, spread[0])
    check_close("x.grad", x.grad, xr.grad, spread[1])
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        check_close(f"{name}.grad", p.grad, params[name].grad, spread[2 + names.index(name)])


@pytest.mark.parametrize("device", DEVICES)
def test_a_two_layer_model_learns(device):
    torch.manual_seed(1)
    tokens = 256
    model = torch.nn.Sequential(
        torch.nn.Linear(D, D, device=device, dtype=torch.bfloat16),
        mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device),
        torch.nn.Linear(D, 1, device=device, dtype=torch.bfloat16),
    )
    x = torch.randn(tokens, D, device=device, dtype=torch.bfloat16)
    target = torch.sin(x.float().sum(dim=1, keepdim=True))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


@needs_gpu
def test_a_step_replays_from_a_cuda_graph():
    torch.manual_seed(2)
    tokens = 200
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F)
    static_x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)

    def step():
        moe.zero_grad(set_to_none=False)
        y = moe(static_x)
        y.float().square().mean().backward()
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the graph: compile, first binds, .grad allocated
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()

    fresh = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    got_y, got_w1 = static_y.clone(), moe.w1.grad.clone()
    eager_y = step()
    torch.cuda.synchronize()
    # The same kernels on the same values; only the order of atomic adds may differ.
    assert normalized_error(got_y, eager_y) < 1e-5
    assert normalized_error(got_w1, moe.w1.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_with_the_message(device):
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device)
    if device == "cuda":
        with pytest.raises(mf.UserError, match="is on cpu, the layer on cuda"):
            moe(torch.randn(16, D, dtype=torch.bfloat16))
    with pytest.raises(mf.UserError, match=r"'x' has shape \(16, 32\); the layer expects \(tokens, 64\)"):
        moe(torch.randn(16, 32, device=device, dtype=torch.bfloat16))
    with pytest.raises(mf.UserError, match="must be a torch.Tensor"):
        moe([[1.0]])
    with pytest.raises(mf.UserError, match=r"expects \(tokens, 64\) or \(\.\.\., 64\)"):
        moe(torch.randn(16, device=device))
    with pytest.raises(mf.UserError, match="keeps no routing .* make it with keep_routing=True"):
        moe.routed_experts()
    with pytest.raises(mf.UserError, match="device must be 'cuda' or 'cpu', got 'meta'"):
        mft.example("moe_mlp", device="meta")
    # Token ids or a mask where activations belong would run as numbers.
    with pytest.raises(mf.UserError, match="'x' has dtype torch.int64; the layer reads floating-point values"):
        moe(torch.ones(16, D, device=device, dtype=torch.int64))
    given = mft.MoELayer(moe.pipeline, device=device, own_params=False)
    weights = {n: getattr(moe, n) for n in moe._weight_names}
    with pytest.raises(mf.UserError, match="the weight 'w1' has dtype torch.bool"):
        given(torch.randn(16, D, device=device), params={**weights, "w1": weights["w1"] > 0})
    with pytest.raises(mf.UserError, match=r"unknown schedule 'fastest': choose 'auto' .* 'default', a preset "
                                           r"\(megablocks, scattermoe\)"):
        mft.MoELayer(moe.pipeline, schedule="fastest", device=device)
    with pytest.raises(mf.UserError, match="schedule must be a moeforge.Schedule or a name .* got int"):
        mft.MoELayer(moe.pipeline, schedule=3, device=device)
    assert mft.MoELayer(moe.pipeline, schedule="default", device=device).schedule_note == "the default schedule"
    # Any dtype and strides are converted (a copy), not refused.
    x = torch.randn(D, 16, device=device, dtype=torch.float32).t()
    y = moe(x)
    ref = moe(x.contiguous().to(torch.bfloat16))
    assert normalized_error(y, ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_constant_inputs_are_buffers_and_bad_ones_are_named(device):
    """An Input not over the tokens (deepseek_moe's expert bias) is a buffer
    the forward reads (no gradient); one of the wrong shape or device is
    named; a layer with two Inputs over the tokens is refused."""
    moe = mft.example("deepseek_moe", experts=E, topk=K, d=D, f=F, device=device)
    assert moe._const_names == ["bias"] and "bias" in dict(moe.named_buffers())
    assert "bias" not in dict(moe.named_parameters())
    x = torch.randn(16, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().sum().backward()
    assert x.grad is not None and moe.bias.grad is None
    moe.bias = torch.zeros(E + 1, device=device)
    with pytest.raises(mf.UserError, match=rf"'bias' has shape \({E + 1},\); the layer expects \({E},\)"):
        moe(x)
    if device == "cuda":
        moe.bias = torch.zeros(E)
        with pytest.raises(mf.UserError, match="the constant input 'bias' is on cpu, the layer on cuda"):
            moe(x)
    Dd = mf.Dim("D", D)
    i = mf.Var("i", Dd)
    w, y = mf.Param("w", [Dd]), mf.Func("y")
    y[i] = w[i] * 2.0
    with pytest.raises(mf.UserError, match=r"an Input over the tokens .*its Inputs \[\] have none"):
        mft.MoELayer(mf.Pipeline([y]), device=device)


def _grads(moe, x):
    return [x.grad.clone()] + [p.grad.clone() for _, p in moe.named_parameters()]


def _step(moe, x, dy):
    """One forward and backward on a fresh leaf copy of x: y and the gradients."""
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = moe(x)
    y.backward(dy)
    return [y.detach()] + _grads(moe, x)


def _check_same(what, got, want, tolerance=1e-5):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what} [{i}]: shape {tuple(g.shape)} != {tuple(w.shape)}"
        err = normalized_error(g, w)
        assert err < tolerance, f"{what} [{i}]: error {err:.3g}"


@pytest.mark.parametrize("device", DEVICES)
def test_forwards_in_flight_each_backward_reads_its_own_forward(device):
    """Two micro-batches of different sizes through one module before either
    backward, the backwards in reverse order: each as its own step alone."""
    torch.manual_seed(4)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device)
    xs = [torch.randn(n, D, device=device, dtype=torch.bfloat16) for n in (37, 200)]
    dys = [torch.randn(n, D, device=device) for n in (37, 200)]
    alone = [_step(moe, x, dy) for x, dy in zip(xs, dys)]
    moe.zero_grad(set_to_none=True)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    ys = [moe(x) for x in leaves]
    ys[1].backward(dys[1])
    second = [ys[1].detach(), leaves[1].grad.clone()] + [p.grad.clone() for _, p in moe.named_parameters()]
    moe.zero_grad(set_to_none=True)
    ys[0].backward(dys[0])
    first = [ys[0].detach(), leaves[0].grad.clone()] + [p.grad.clone() for _, p in moe.named_parameters()]
    _check_same("the later forward's step", second, alone[1])
    _check_same("the earlier forward's step", first, alone[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing(device, reentrant):
    """torch.utils.checkpoint around a block holding the module: its forward
    runs again in the backward; the gradients are those of a plain step."""
    torch.manual_seed(5)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device)
    lin = torch.nn.Linear(D, D, device=device, dtype=torch.bfloat16)

    def block(h):
        return moe(lin(h)) + h.float()

    x = torch.randn(96, D, device=device, dtype=torch.bfloat16)
    dy = torch.randn(96, D, device=device)
    grads = []
    for checkpointed in (False, True):
        moe.zero_grad(set_to_none=True)
        lin.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_(True)
        if checkpointed:
            y = torch.utils.checkpoint.checkpoint(block, xl, use_reentrant=reentrant)
        else:
            y = block(xl)
        y.backward(dy)
        grads.append([y.detach(), xl.grad.clone(), lin.weight.grad.clone()] +
                     [p.grad.clone() for _, p in moe.named_parameters()])
    # Reentrant checkpointing runs the first forward under no_grad: the
    # forward alone (the inference program, its own fusions), so y agrees to
    # its rounding; the gradients come from the forward run again.
    _check_same("checkpointed y against plain", grads[1][:1], grads[0][:1], 1e-5 if not reentrant else 1e-2)
    _check_same("checkpointed against plain", grads[1][1:], grads[0][1:])


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_over_micro_batches(device):
    """Two micro-batches' gradients accumulated: those of one batch of both
    (the routing is per token), up to the order of bf16 sums."""
    torch.manual_seed(6)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device)
    x = torch.randn(160, D, device=device, dtype=torch.bfloat16)
    dy = torch.randn(160, D, device=device)
    whole = _step(moe, x, dy)[2:]
    moe.zero_grad(set_to_none=True)
    for part in (slice(0, 70), slice(70, 160)):
        moe(x[part]).backward(dy[part])
    _check_same("accumulated against one batch", [p.grad for _, p in moe.named_parameters()], whole, 1e-2)


@needs_gpu
def test_a_steady_training_loop_replays_its_graphs():
    """Steps at one token count, and a module applied twice per step (two
    address sets in turn): after the warm-up every forward and backward
    replays a CUDA graph of the layer's own, none is captured or run eagerly."""
    torch.manual_seed(4)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F)
    x = torch.randn(200, D, device="cuda", dtype=torch.bfloat16)
    for twice in (False, True):
        def step():
            moe.zero_grad(set_to_none=True)
            y = moe(moe(x)) if twice else moe(x)
            y.float().square().mean().backward()

        for _ in range(4):
            step()
        torch.cuda.synchronize()
        before = moe._caller.layer.graph_counts()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        after = moe._caller.layer.graph_counts()
        calls = 3 * 2 * (2 if twice else 1)  # steps x (forward, backward) x applications
        assert {k: after[k] - before[k] for k in after} == {"replayed": calls, "captured": 0, "eager": 0}, twice


@pytest.mark.parametrize("device", DEVICES)
def test_a_module_applied_twice_in_one_graph(device):
    """moe(moe(x)): the gradients are the sums of two modules' with the
    same weights, each applied once."""
    torch.manual_seed(7)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device)
    a, b = (mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device) for _ in range(2))
    a.load_state_dict(moe.state_dict())
    b.load_state_dict(moe.state_dict())
    x = torch.randn(64, D, device=device, dtype=torch.bfloat16)
    dy = torch.randn(64, D, device=device)
    xt = x.clone().requires_grad_(True)
    moe(moe(xt)).backward(dy)
    xs = x.clone().requires_grad_(True)
    b(a(xs)).backward(dy)
    want = [xs.grad] + [pa.grad.float() + pb.grad.float() for pa, pb in zip(a.parameters(), b.parameters())]
    _check_same("twice against two copies", [xt.grad] + [p.grad for p in moe.parameters()], want, 1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_backward_of_one_forward(device):
    """The default schedule's backward writes the activation gradients over
    the saved pre-activations (gradients_over_saved): a second backward
    through one forward (retain_graph) is refused with the reason. Without
    that choice it runs, and adds the same gradients again."""
    torch.manual_seed(8)
    x = torch.randn(96, D, device=device, dtype=torch.bfloat16)
    dy = torch.randn(96, D, device=device)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device)
    assert "gradients_over_saved(true)" in moe.schedule.to_text()
    y = moe(x.clone().requires_grad_(True))
    y.backward(dy, retain_graph=True)
    with pytest.raises(mf.UserError, match=r"run the forward again.*gradients_over_saved\(false\)"):
        y.backward(dy)
    keep = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device,
                       schedule=mf.Schedule.from_text(moe.schedule.to_text()).gradients_over_saved(False))
    keep.load_state_dict(moe.state_dict())
    once = _step(keep, x, dy)
    keep.zero_grad(set_to_none=True)
    xt = x.clone().requires_grad_(True)
    y = keep(xt)
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    _check_same("two backwards", [xt.grad] + [p.grad.float() for p in keep.parameters()],
                [2 * g.float() for g in once[1:]], 2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_any_token_count_through_one_module(device):
    """0, 1, 37 and 4096 tokens (and 16384 on the GPU) through one module,
    one compile: each against plain PyTorch on the module's own routing."""
    torch.manual_seed(8)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device, keep_routing=True)
    counts = [1, 0, 37, 4096] + ([16384] if device == "cuda" else [])
    names = PLAIN["moe_mlp"][1]
    compiled = None
    for tokens in counts:
        x = torch.randn(tokens, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        moe.zero_grad(set_to_none=True)
        y = moe(x)
        assert y.shape == (tokens, D) and y.dtype == torch.bfloat16  # the default's bf16_boundary, 0 tokens too
        dy = torch.randn_like(y)
        y.backward(dy)
        runtime = moe._caller
        if tokens == 0:
            assert x.grad.shape == (0, D)
            assert all(p.grad is not None and not p.grad.abs().any() for p in moe.parameters())
            continue
        if compiled is None:
            compiled = runtime.layer
        else:
            assert runtime.layer is compiled, "a new token count compiled a new layer"
        experts = moe.routed_experts(tokens)
        params = [getattr(moe, n) for n in names]
        ref = plain_step(torch_moe_mlp, x, params, experts, dy)
        # A token or two make the router's gradient a cancellation: judged
        # by its rounding spread there.
        spread = rounding_spread(torch_moe_mlp, x, params, experts, dy) if tokens < 64 else [0.0] * len(ref)
        check_close(f"y at {tokens}", y, ref[0], spread[0])
        check_close(f"x.grad at {tokens}", x.grad, ref[1], spread[1])
        for i, (n, want) in enumerate(zip(names, ref[2:])):
            check_close(f"{n}.grad at {tokens}", getattr(moe, n).grad, want, spread[2 + i])


@pytest.mark.parametrize("device", DEVICES)
def test_the_output_and_input_gradient_in_the_models_dtype(device):
    """Under the default (bf16_boundary) y and x.grad are bf16, as a bf16
    model passes them, and agree with the f32 boundary's to bf16 rounding;
    where atomic_combine adds y up, y stays f32, and says so by its dtype."""
    torch.manual_seed(12)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device)
    wide = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device,
                       schedule=mf.Schedule.from_text(moe.schedule.to_text()).bf16_boundary(False))
    atomic = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device,
                         schedule=mf.Schedule.from_text(moe.schedule.to_text()).atomic_combine(True))
    for other in (wide, atomic):
        other.load_state_dict(moe.state_dict())
    x = torch.randn(96, D, device=device, dtype=torch.bfloat16)
    dy = torch.randn(96, D, device=device, dtype=torch.bfloat16)
    got = {}
    for name, m in (("bf16", moe), ("f32", wide), ("atomic", atomic)):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(dy.to(y.dtype))
        got[name] = (y, xi.grad)
        assert xi.grad.dtype == torch.bfloat16
        assert m(x[:0]).dtype == y.dtype  # no tokens: the same dtype
    assert got["bf16"][0].dtype == torch.bfloat16
    assert got["f32"][0].dtype == torch.float32
    assert got["atomic"][0].dtype == torch.float32
    for name in ("f32", "atomic"):
        assert normalized_error(got["bf16"][0], got[name][0]) < 1e-2, name
        assert normalized_error(got["bf16"][1], got[name][1]) < 2e-2, name


@pytest.mark.parametrize("device", DEVICES)
def test_batch_and_sequence_dimensions(device):
    torch.manual_seed(9)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device)
    x = torch.randn(3, 5, D, device=device, dtype=torch.bfloat16)
    y = moe(x)
    assert y.shape == (3, 5, D)
    assert normalized_error(y.reshape(15, D), moe(x.reshape(15, D))) < 1e-6


@needs_gpu
def test_a_backward_frees_its_forwards_memory_while_the_graph_lives():
    """A layer's saved activations go when its backward ends, not when the
    graph is dropped: in a stack, the first layers' backwards then run
    without the later layers' activations. After y.backward(dy) with y (and
    so its graph) still alive, torch holds what it held before the forward
    plus y alone (the gradients were allocated by a warm-up step)."""
    torch.manual_seed(11)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F)
    x = torch.randn(256, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, D, device="cuda")
    moe(x).backward(dy)
    moe.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = moe(x)
    assert torch.cuda.memory_allocated() > before + y.numel() * y.element_size(), "the forward saved nothing?"
    y.backward(dy)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert held == y.numel() * y.element_size(), f"{held} bytes held after the backward, y is {y.numel() * y.element_size()}"


@needs_gpu
def test_a_backward_holds_no_second_copy_of_its_saved_activations():
    """The backward's peak above what was alive before it stays under the
    saved region's size: no zero "gradient" of the saved region (the
    forward op's uint8 output, which no loss reads) is made beside it, as
    autograd's materialised gradients did (H100, 2026-12-05: 754 MiB a
    layer at fine64's shape). The weights are small and the token count
    large, so the saved region dwarfs the gradients and the workspace."""
    torch.manual_seed(12)
    moe = mft.example("swiglu_moe", experts=8, topk=2, d=256, f=512)
    x = torch.randn(32768, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(32768, 256, device="cuda", dtype=torch.bfloat16)
    moe(x).backward(dy)  # compiles; the gradients exist from here
    torch.cuda.synchronize()
    y = moe(x)
    saved = moe.saved_bytes(x.shape[0])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(dy)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert saved > 64 * 2 ** 20
    assert extra < saved, f"the backward took {extra} bytes beside a saved region of {saved}"


@needs_gpu
def test_memory_returns_to_the_weights_after_every_step():
    """100 steps at varying token counts: after each, torch holds the
    weights and their gradients only, and nothing outside torch's allocator
    grew (the module allocates none of its own)."""
    torch.manual_seed(10)
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F)
    x0 = torch.randn(64, D, device="cuda", dtype=torch.bfloat16)
    moe(x0).sum().backward()  # compiles; the persistent GEMMs' counters are made here
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    free0, _ = torch.cuda.mem_get_info()
    reserved0 = torch.cuda.memory_reserved()
    counts = torch.randint(1, 3000, (100,)).tolist()
    for tokens in counts:
        x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        moe(x).float().square().mean().backward()
        del x
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == baseline, f"after a step of {tokens} tokens"
    free1, _ = torch.cuda.mem_get_info()
    outside = (free0 - free1) - (torch.cuda.memory_reserved() - reserved0)
    assert abs(outside) < 4 * 2 ** 20, f"{outside} bytes allocated outside torch's allocator over 100 steps"


@pytest.mark.parametrize("device", DEVICES)
def test_auto_runs_the_default_schedule_where_nothing_is_tuned(device, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path))  # an empty tuned-schedule cache
    moe = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F, device=device)
    assert moe.schedule.name == "default"
    assert moe.schedule.to_text() == mf.default_schedule(moe.pipeline, moe.outputs).to_text()
    x = torch.randn(48, D, device=device, dtype=torch.bfloat16)
    moe(x).sum().backward()
    assert moe.schedule.name == "default"
    if device == "cuda":
        assert "nothing tuned for this layer here" in moe.schedule_note, moe.schedule_note
    # A schedule named is the one run.
    assert mft.example("moe_mlp", device=device, schedule="megablocks").schedule.name == "megablocks"


@needs_gpu
def test_tune_caches_a_schedule_that_auto_then_runs(tmp_path, monkeypatch):
    """moeforge.tune from Python: the winner lands in the tuned-schedule
    cache, where a module with schedule="auto" finds it at its first forward
    and computes what the default schedule computes."""
    monkeypatch.setenv("MOEFORGE_CACHE_DIR", str(tmp_path))
    tokens = 256
    plain = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F)
    x = torch.randn(tokens, D, device="cuda", dtype=torch.bfloat16)
    y_plain = plain(x)  # its first forward, before the tune: the default schedule
    assert "nothing tuned" in plain.schedule_note, plain.schedule_note
    best, info = mf.tune(plain.pipeline, tokens, plain.outputs, budget_seconds=20)
    assert info["cached"].startswith(str(tmp_path)), info
    assert info["timed"] >= 1 and info["best_ms"] > 0, info
    cached, where = mf.cached_schedule(plain.pipeline, tokens, True, 0)
    assert cached is not None and cached.to_text() == best.to_text(), where
    auto = mft.example("swiglu_moe", experts=E, topk=K, d=D, f=F)
    auto.load_state_dict(plain.state_dict())
    y_auto = auto(x)
    assert "tuned for this layer" in auto.schedule_note, auto.schedule_note
    assert auto.schedule.to_text() == best.to_text()
    err = (y_auto.float() - y_plain.float()).abs().max() / y_plain.float().abs().max()
    assert err < 2e-2, err


@pytest.mark.parametrize("device", DEVICES)
def test_an_auxiliary_loss_comes_back_as_a_tensor_and_trains_the_router(device):
    """forward() returns (y, lb_loss); the loss's gradient reaches wr, as in
    the Switch Transformer's formula written in plain PyTorch."""
    torch.manual_seed(3)
    m = moe_mlp_parts(D, F, E, K)
    lb = mf.load_balancing_loss(m.route, m.probs, m.e, coefficient=0.01)
    moe = mft.MoELayer(mf.Pipeline([m.y, lb]), schedule="scattermoe", device=device, keep_routing=True)
    tokens = 96
    xt = torch.randn(tokens, D, device=device, dtype=torch.bfloat16)
    out, loss = moe(xt)
    assert out.shape == (tokens, D) and loss.shape == ()
    loss.backward()

    # The same loss in plain PyTorch, with the layer's routing.
    wr_ref = moe.wr.detach().float().clone().requires_grad_(True)
    p = torch.softmax(xt.float() @ wr_ref, dim=1)
    experts = moe.routed_experts(tokens).long().to(device)
    fraction = torch.bincount(experts, minlength=E).float() / (tokens * K)
    want = 0.01 * E * (fraction * p.mean(dim=0)).sum()
    want.backward()
    assert abs(loss.item() - want.item()) < 1e-3 * abs(want.item())
    assert normalized_error(moe.wr.grad, wr_ref.grad) < 2e-2
    assert moe.w1.grad is not None and moe.w1.grad.abs().max().item() == 0.0  # the loss ignores the experts


@pytest.mark.parametrize("device", DEVICES)
def test_a_copied_module_is_a_module_of_its_own(device):
    """copy.deepcopy gives the copy its own handle and runtime: each runs
    on its own weights and keeps its own routing."""
    import copy
    torch.manual_seed(12)
    moe = mft.example("moe_mlp", experts=E, topk=K, d=D, f=F, device=device, keep_routing=True)
    x = torch.randn(40, D, device=device, dtype=torch.bfloat16)
    y = moe(x)
    twin = copy.deepcopy(moe)
    assert twin._handle != moe._handle
    with torch.no_grad():
        twin.w2.mul_(2)
    assert normalized_error(twin(x), 2 * y.float()) < 2e-2
    assert normalized_error(moe(x), y) < 1e-6
    assert torch.equal(twin.routed_experts(40), moe.routed_experts(40))


@pytest.mark.parametrize("device", DEVICES)
def test_several_inputs_over_the_tokens_and_weights_given_per_call(device):
    """A layer of two Inputs over the tokens (x and a given routing's
    scores) takes both as forward()'s arguments, in the order `inputs`
    names them, (batch, seq, width) too; with own_params=False it holds no
    weights and reads those each call is given, and gradients reach them.
    Bad calls are named."""
    import moeforge.transformers as mftf
    torch.manual_seed(41)
    moe = mft.MoELayer(mftf.given_routing_pipeline(D, F, E, K), device=device, own_params=False,
                       inputs=["x", "scores"], stored_in=mftf.gate_up_storage(F, D))
    assert moe.input_names == ["x", "scores"] and list(moe.parameters()) == []
    weights = {"gate_up_proj": torch.randn(E, 2 * F, D), "w2": torch.randn(E, D, F)}
    weights = {n: (w * 0.1).to(device=device, dtype=torch.bfloat16).requires_grad_(True) for n, w in weights.items()}
    x = torch.randn(2, 9, D, device=device).to(torch.bfloat16)
    scores = torch.rand(2, 9, E, device=device)
    y = moe(x, scores, params=weights)
    assert y.shape == (2, 9, D)
    y.float().sum().backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in weights.values())
    flat = moe(x.reshape(18, D), scores.reshape(18, E), params=weights)
    assert torch.equal(flat.reshape(2, 9, D), y)
    with pytest.raises(mf.UserError, match=r"forward\(\) takes the layer's 2 Input\(s\) over the tokens \(x, scores\), "
                                           r"got 1"):
        moe(x, params=weights)
    with pytest.raises(mf.UserError, match=r"'scores' has shape \(18, 8\), over other tokens than 'x' \(2, 9, 64\)"):
        moe(x, scores.reshape(18, E), params=weights)
    with pytest.raises(mf.UserError, match=r"own_params=False\): forward\(\) needs params=\{...\} with every weight "
                                           r"\(gate_up_proj, w2\); 'w2' is missing"):
        moe(x, scores, params={"gate_up_proj": weights["gate_up_proj"]})
    with pytest.raises(mf.UserError, match=r"the weight 'gate_up_proj' given has shape \(8, 64, 256\); the layer "
                                           r"expects \(8, 256, 64\)"):
        moe(x, scores, params={**weights, "gate_up_proj": weights["gate_up_proj"].transpose(1, 2)})
    with pytest.raises(mf.UserError, match=r"params names \['w1'\], not weights of this layer"):
        moe(x, scores, params={**weights, "w1": weights["w2"]})
    with pytest.raises(mf.UserError, match=r"inputs=\['x'\] must name each Input over the tokens once"):
        mft.MoELayer(mftf.given_routing_pipeline(D, F, E, K), device=device, inputs=["x"])


@pytest.mark.parametrize("device", DEVICES)
def test_params_stored_inside_one_tensor_are_read_and_written_there(device):
    """w1 and w3 declared as the halves of one gate_up tensor (outer_stride
    2 F d, stored_in): the module's one Parameter is that tensor, the
    layer reads it in place, and its gradient comes back as one tensor,
    each half's gradient in its place; the same layer over dense w1 and w3
    copied out of it gives the same output and gradients."""
    import moeforge.transformers as mftf
    torch.manual_seed(42)
    strided = mft.MoELayer(mftf.given_routing_pipeline(D, F, E, K), device=device, inputs=["x", "scores"],
                           stored_in=mftf.gate_up_storage(F, D))
    assert [n for n, _ in strided.named_parameters()] == ["gate_up_proj", "w2"]
    assert strided.gate_up_proj.shape == (E, 2 * F, D)
    T, Dd, Ff, Ee = mf.Dim.dynamic("T"), mf.Dim("D", D), mf.Dim("F", F), mf.Dim("E", E)
    t, e, i, j = mf.Var("t", T), mf.Var("e", Ee), mf.Var("i", Dd), mf.Var("j", Ff)
    x_in, scores_in = mf.Input("x", [T, Dd]), mf.Input("scores", [T, Ee], mf.f32)
    w1, w3, w2 = mf.Param("w1", [Ee, Ff, Dd]), mf.Param("w3", [Ee, Ff, Dd]), mf.Param("w2", [Ee, Dd, Ff])
    choice, h, o, y = mf.Func("choice", mf.f32), mf.Func("h"), mf.Func("o"), mf.Func("y")
    choice[t, e] = scores_in[t, e]
    route = mf.top_k(choice, e, K)
    r = route.pair
    h[r, j] = (mf.silu(mf.sum(i, x_in[route.token(r), i] * w1[route.expert(r), j, i])) *
               mf.sum(i, x_in[route.token(r), i] * w3[route.expert(r), j, i]))
    o[r, i] = mf.sum(j, h[r, j] * w2[route.expert(r), i, j])
    y[t, i] = mf.combine(route, t, route.gate(r) * o[r, i])
    dense = mft.MoELayer(mf.Pipeline([y]), device=device, inputs=["x", "scores"])
    with torch.no_grad():
        dense.w1.copy_(strided.gate_up_proj[:, :F])
        dense.w3.copy_(strided.gate_up_proj[:, F:])
        dense.w2.copy_(strided.w2)
    x = torch.randn(37, D, device=device).to(torch.bfloat16)
    scores = torch.rand(37, E, device=device)
    got, want = strided(x, scores), dense(x, scores)
    assert torch.equal(got, want)
    dy = torch.randn_like(got)
    got.backward(dy)
    want.backward(dy)
    assert torch.equal(strided.gate_up_proj.grad[:, :F], dense.w1.grad)
    assert torch.equal(strided.gate_up_proj.grad[:, F:], dense.w3.grad)
    assert torch.equal(strided.w2.grad, dense.w2.grad)


@pytest.mark.skipif(not mf.has_cpu_backend, reason="no CPU backend")
def test_params_inside_a_tensor_need_it_named_and_must_fit_it():
    import moeforge.transformers as mftf
    pipeline = mftf.given_routing_pipeline(D, F, E, K)
    with pytest.raises(mf.UserError, match=r"Param 'w1' is stored every 16384 elements along its first dim, inside a "
                                           r"larger tensor: name that tensor"):
        mft.MoELayer(pipeline, device="cpu")
    with pytest.raises(mf.UserError, match=r"stored_in\['gate_up_proj'\]: 'w1' at 0 and 'w3' at 64 overlap"):
        mft.MoELayer(pipeline, device="cpu", stored_in={"gate_up_proj": {"w1": 0, "w3": 64}})
    with pytest.raises(mf.UserError, match=r"stored_in\['gate_up_proj'\]: each Param's offset must lie in \[0, 8192\]"):
        mft.MoELayer(pipeline, device="cpu", stored_in={"gate_up_proj": {"w1": 0, "w3": 8200}})
    with pytest.raises(mf.UserError, match=r"stored_in\['gate_up_proj'\] names 'w9', not a Param of this layer"):
        mft.MoELayer(pipeline, device="cpu", stored_in={"gate_up_proj": {"w1": 0, "w9": 8192}})
    with pytest.raises(mf.UserError, match=r"outer_stride 100 must be a multiple of 8 elements"):
        mf.Param("w", [mf.Dim("E", 2), mf.Dim("F", 4)], mf.bf16, outer_stride=100)
    with pytest.raises(mf.UserError, match=r"outer_stride 2 is less than the 4 elements of one index"):
        mf.Param("w", [mf.Dim("E", 2), mf.Dim("F", 4)], mf.bf16, outer_stride=2)
