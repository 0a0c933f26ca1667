"""A routing score that is NaN or infinite, through moeforge.torch (skipped
without torch): never routed silently. The CPU layer refuses it in the
forward; the GPU's forward is queued without waiting, so the token's gates
go NaN (y shows it) and check_routing_scores() (or the module's next forward
or backward) raises it, naming the token and the expert."""

import pytest

import moeforge as mf

torch = pytest.importorskip("torch")

import moeforge.torch as mft  # noqa: E402
from test_torch import DEVICES, needs_gpu  # noqa: E402


def poisoned_input(device, tokens=16, d=64):
    torch.manual_seed(3)
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    clean = x.clone()
    x[3, 5] = float("nan")  # token 3's router logits, and so its probabilities, all NaN
    return x, clean


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_a_nan_routing_score_is_raised_naming_the_token(device, grad):
    module = mft.example("swiglu_moe", experts=8, topk=2, d=64, f=128, device=device)
    x, clean = poisoned_input(device)
    with torch.set_grad_enabled(grad):
        if device == "cpu":
            with pytest.raises(mf.UserError, match="routing score of token 3, expert 0 is nan"):
                module(x)
        else:
            y = module(x)
            assert torch.isnan(y[3].float()).all()  # its gates are NaN
            assert torch.isfinite(y[:3].float()).all() and torch.isfinite(y[4:].float()).all()
            with pytest.raises(mf.UserError, match="routing score of token 3, expert 0 is NaN or infinite"):
                module.check_routing_scores()
            module.check_routing_scores()  # reported once, then cleared
        y = module(clean)  # the module works on after the error
        module.check_routing_scores()
        assert torch.isfinite(y.float()).all()


@needs_gpu
def test_the_next_forward_raises_what_the_last_one_routed():
    module = mft.example("swiglu_moe", experts=8, topk=2, d=64, f=128, device="cuda")
    x, clean = poisoned_input("cuda")
    module(x)
    torch.cuda.synchronize()
    with pytest.raises(mf.UserError, match="token 3, expert 0 is NaN or infinite on the GPU"):
        module(clean)
    y = module(clean)
    torch.cuda.synchronize()
    module.check_routing_scores()
    assert torch.isfinite(y.float()).all()
