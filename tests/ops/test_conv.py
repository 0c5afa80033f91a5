"""causal_conv1d against a plain loop over tokens, with state carry and packed sequences."""

import pytest
import torch
import torch.nn.functional as F

from moe_plugin.ops.conv import causal_conv1d


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def loop_conv(x, weight, bias, activation, history):
    """x ``[T, C]``, history ``[W-1, C]`` (oldest first) -> (y ``[T, C]``, last W-1 inputs ``[W-1, C]``)."""
    W = weight.shape[1]
    seq = torch.cat([history, x]) if W > 1 else x
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for w in range(W):
            acc = acc + weight[:, w] * seq[t + w]
        if bias is not None:
            acc = acc + bias
        out.append(F.silu(acc) if activation == "silu" else acc)
    y = torch.stack(out) if out else x.new_zeros(0, x.shape[1])
    return y, seq[seq.shape[0] - (W - 1) :]


@pytest.mark.parametrize("W", [4, 2, 1])
@pytest.mark.parametrize("activation,with_bias,with_state", [("silu", False, True), (None, True, False)])
def test_matches_loop(W, activation, with_bias, with_state):
    torch.manual_seed(0)
    B, T, C = 2, 9, 5
    x = torch.randn(B, T, C, dtype=torch.float64)
    weight = torch.randn(C, W, dtype=torch.float64)
    bias = torch.randn(C, dtype=torch.float64) if with_bias else None
    h0 = torch.randn(B, C, W - 1, dtype=torch.float64) if with_state else None
    y, final = causal_conv1d(x, weight, bias, activation, initial_state=h0, output_final_state=True)
    for b in range(B):
        history = h0[b].T if with_state else torch.zeros(W - 1, C, dtype=torch.float64)
        y_ref, final_ref = loop_conv(x[b], weight, bias, activation, history)
        assert rel(y[b], y_ref) <= 1e-12
        assert final[b].shape == (C, W - 1) and torch.equal(final[b], final_ref.T)


def test_state_carry_equals_one_pass():
    """Running the sequence in three pieces, passing the state on, equals one pass (what decoding relies on)."""
    torch.manual_seed(1)
    x = torch.randn(2, 12, 6, dtype=torch.float64)
    weight = torch.randn(6, 4, dtype=torch.float64)
    y_full, s_full = causal_conv1d(x, weight, output_final_state=True)
    state, pieces = None, []
    for a, b in ((0, 2), (2, 3), (3, 12)):
        y, state = causal_conv1d(x[:, a:b], weight, initial_state=state, output_final_state=True)
        pieces.append(y)
    assert rel(torch.cat(pieces, 1), y_full) <= 1e-14 and torch.equal(state, s_full)


def test_packed_sequences_reset_at_boundaries():
    torch.manual_seed(2)
    lengths = [4, 0, 1, 7]
    cu = torch.tensor([0, 4, 4, 5, 12])
    C, W = 3, 4
    x = torch.randn(1, sum(lengths), C, dtype=torch.float64)
    weight = torch.randn(C, W, dtype=torch.float64)
    h0 = torch.randn(len(lengths), C, W - 1, dtype=torch.float64)
    y, final = causal_conv1d(x, weight, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_ref, final_ref = loop_conv(x[0, a:b], weight, None, "silu", h0[i].T)
        if b > a:
            assert rel(y[0, a:b], y_ref) <= 1e-12
        assert torch.equal(final[i], final_ref.T)


def test_gradients_flow_to_inputs_weight_and_state():
    x = torch.randn(1, 6, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(1, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: causal_conv1d(a[0], a[1], a[2], initial_state=a[3], output_final_state=True), (x, weight, bias, h0)
    )


def test_packed_gradients_flow_to_inputs_weight_and_state():
    cu = torch.tensor([0, 2, 2, 7])  # a sequence shorter than the window, an empty one
    x = torch.randn(1, 7, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *a: causal_conv1d(a[0], a[1], initial_state=a[2], output_final_state=True, cu_seqlens=cu),
        (x, weight, h0),
    )


def test_bad_input_names_the_argument():
    x = torch.randn(2, 5, 3)
    w = torch.randn(3, 4)
    with pytest.raises(ValueError, match="^x:"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="^weight:"):
        causal_conv1d(x, torch.randn(4, 4))
    with pytest.raises(ValueError, match="^bias:"):
        causal_conv1d(x, w, bias=torch.randn(2))
    with pytest.raises(ValueError, match="weight=torch.float64"):
        causal_conv1d(x, w.double())
    with pytest.raises(ValueError, match="^activation:"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="^initial_state:"):
        causal_conv1d(x, w, initial_state=torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 5]))


def test_host_int_offsets_equal_the_tensor_and_are_checked():
    torch.manual_seed(0)
    x, w = torch.randn(1, 11, 5), torch.randn(5, 4)
    offsets = [0, 3, 3, 9, 11]  # an empty sequence too
    want, want_final = causal_conv1d(x, w, output_final_state=True, cu_seqlens=torch.tensor(offsets))
    got, got_final = causal_conv1d(x, w, output_final_state=True, cu_seqlens=tuple(offsets))
    assert torch.equal(got, want) and torch.equal(got_final, want_final)
    for bad in ([0, 3, 10], [1, 11], [0, 5, 4, 11]):
        with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets from 0"):
            causal_conv1d(x, w, cu_seqlens=bad)
    with pytest.raises(ValueError, match="batch size 1"):
        causal_conv1d(torch.randn(2, 11, 5), w, cu_seqlens=offsets)
