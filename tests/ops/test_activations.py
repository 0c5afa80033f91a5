"""Gated activations against their formulas (docs/architecture.md 2.3), and the packed fast form against them."""

import pytest
import torch

from moe_plugin.ops.activations import glu, glu_packed, situ_glu, swiglu


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_situ_matches_formula_and_saturates():
    torch.manual_seed(0)
    a, b = torch.randn(64) * 30, torch.randn(64) * 100
    want = (4 * torch.tanh(a.double() / 4) * torch.sigmoid(a.double())) * (25 * torch.tanh(b.double() / 25))
    assert rel(situ_glu(a, b), want) < 1e-6
    assert situ_glu(a, b).abs().max() <= 4 * 25  # both factors are soft-capped
    assert (
        rel(
            situ_glu(a, b, beta=2.0, linear_beta=5.0),
            (2 * torch.tanh(a / 2) * torch.sigmoid(a)) * (5 * torch.tanh(b / 5)),
        )
        < 1e-6
    )


def test_situ_bf16_computed_in_fp32():
    torch.manual_seed(1)
    a, b = torch.randn(256) * 3, torch.randn(256) * 3
    out = situ_glu(a.bfloat16(), b.bfloat16())
    assert out.dtype == torch.bfloat16
    # only the final rounding differs from fp32 math on the same (bf16-rounded) inputs
    exact = situ_glu(a.bfloat16().float(), b.bfloat16().float())
    assert torch.equal(out, exact.bfloat16())


def test_swiglu_and_dispatch():
    torch.manual_seed(2)
    a, b = torch.randn(50), torch.randn(50)
    assert rel(swiglu(a, b), a * torch.sigmoid(a) * b) < 1e-6
    assert torch.equal(glu("swiglu", a, b), swiglu(a, b))
    assert torch.equal(glu("situ", a, b, beta=3.0), situ_glu(a, b, beta=3.0))


@pytest.mark.parametrize("kind", ["situ", "swiglu"])
def test_glu_packed_matches_glu_with_gradients(kind):
    torch.manual_seed(3)
    gate_up = (torch.randn(7, 2, 18, dtype=torch.float64) * 6).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: glu_packed(kind, t, beta=3.0, linear_beta=7.0), (gate_up,))
    x = gate_up.detach().float().requires_grad_()
    y = glu_packed(kind, x, beta=3.0, linear_beta=7.0)
    x2 = x.detach().clone().requires_grad_()
    y2 = glu(kind, x2[..., :9], x2[..., 9:], beta=3.0, linear_beta=7.0)
    assert rel(y, y2) < 1e-6
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert rel(x.grad, x2.grad) < 1e-5


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: glu("gelu", torch.zeros(3), torch.zeros(3)), "activation"),
        (lambda: glu_packed("relu", torch.zeros(4)), "activation"),
        (lambda: glu_packed("situ", torch.zeros(3)), "gate_up"),
        (lambda: situ_glu(torch.zeros(3), torch.zeros(4)), "up"),
        (lambda: swiglu(torch.zeros(3, dtype=torch.long), torch.zeros(3)), "gate"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()
