"""ops/moe/grouped_mm.py: the custom op ``moe_plugin::grouped_mm`` against a plain loop over row blocks (values
and both gradients), on meta (the fake kernel, fp32 too), and what its backward keeps for frozen weights."""

import pytest
import torch

from moe_plugin.ops.moe.grouped_mm import grouped_mm, grouped_mm_supported


def _loop(a, b, sizes):
    return torch.cat([block @ w for block, w in zip(a.split(sizes), b.unbind(0))])


@pytest.mark.parametrize("sizes", [[3, 0, 7], [10], [0, 0, 4, 6]])
def test_equals_a_loop_over_blocks_with_both_gradients(sizes):
    torch.manual_seed(0)
    a = torch.randn(sum(sizes), 16, requires_grad=True)
    b = torch.randn(len(sizes), 16, 8, requires_grad=True)
    assert grouped_mm_supported(a, b.transpose(1, 2))
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = grouped_mm(a, b, offs)
    probe = torch.randn_like(out)
    ga, gb = torch.autograd.grad((out * probe).sum(), (a, b))
    ref = _loop(a, b, sizes)
    ra, rb = torch.autograd.grad((ref * probe).sum(), (a, b))
    for got, want in ((out, ref), (ga, ra), (gb, rb)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_backward_of_a_sum_takes_the_expanded_gradient():
    """``out.sum()``'s gradient has zero strides, which the kernel refuses; the op's backward makes it dense."""
    torch.manual_seed(0)
    a = torch.randn(9, 16, requires_grad=True)
    b = torch.randn(2, 16, 8, requires_grad=True)
    offs = torch.tensor([4, 9], dtype=torch.int32)
    ga, gb = torch.autograd.grad(grouped_mm(a, b, offs).sum(), (a, b))
    ra, rb = torch.autograd.grad(_loop(a, b, [4, 5]).sum(), (a, b))
    assert torch.allclose(ga, ra, rtol=1e-5, atol=1e-6) and torch.allclose(gb, rb, rtol=1e-5, atol=1e-6)


def test_runs_on_meta_in_fp32():
    with torch.device("meta"):
        a = torch.empty(10, 16, requires_grad=True)
        b = torch.empty(3, 16, 8, requires_grad=True)
        assert grouped_mm_supported(a, b.transpose(1, 2))
        out = grouped_mm(a, b, torch.empty(3, dtype=torch.int32))
        out.sum().backward()
    assert out.shape == (10, 8) and a.grad.shape == (10, 16) and b.grad.shape == (3, 16, 8)


def test_frozen_weights_keep_only_the_weights():
    """Under LoRA the experts' weights take no gradient: backward needs them, not the rows."""
    saved = []
    a = torch.randn(6, 16, requires_grad=True)
    b = torch.randn(2, 16, 8)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        grouped_mm(a, b, torch.tensor([2, 6], dtype=torch.int32))
    assert not any(t.shape == a.shape for t in saved)
    assert any(t.shape == (2, 8, 16) or t.shape == b.shape for t in saved)


def test_operands_off_the_16_byte_boundary_are_taken():
    """Views that start 4 bytes into their buffers: the op copies them for the kernel, same values."""
    torch.manual_seed(0)
    a = torch.randn(9 * 16 + 1)[1:].view(9, 16).requires_grad_()
    b = torch.randn(2 * 16 * 8 + 1)[1:].view(2, 16, 8).requires_grad_()
    assert a.data_ptr() % 16 and b.data_ptr() % 16 and grouped_mm_supported(a, b.transpose(1, 2))
    offs = torch.tensor([4, 9], dtype=torch.int32)
    out, ref = grouped_mm(a, b, offs), _loop(a, b, [4, 5])
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_the_experts_compile_in_one_graph():
    """``grouped_glu`` (the dispatch decision, the [w1; w3] product, the GLU, the down product) traces with
    ``fullgraph=True``: nothing in it reads an address or a value on the host."""
    from moe_plugin.ops.moe.experts import grouped_glu

    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w1, w3, w2 = torch.randn(3, 8, 16), torch.randn(3, 8, 16), torch.randn(3, 16, 8)
    tpe = torch.tensor([3, 0, 7])
    probe = torch.randn(10, 16)
    torch._dynamo.reset()
    for activation in ("situ", "swiglu"):
        compiled = torch.compile(grouped_glu, fullgraph=True, backend="aot_eager")
        out = compiled(x, tpe, w1, w3, w2, activation)
        (grad,) = torch.autograd.grad((out * probe).sum(), x)
        ref = grouped_glu(x, tpe, w1, w3, w2, activation)
        (grad_ref,) = torch.autograd.grad((ref * probe).sum(), x)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6) and torch.allclose(grad, grad_ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
