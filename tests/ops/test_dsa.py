"""DSA's attention ops against plain references (tests/ops/dsa_cases.py): causal softmax loops over the
selected or visible keys, with packing, offsets and key masks; every op's bad input named (the indexer's
own checks are here too, one table for the package's DSA entry points)."""

import pytest
import torch

from moe_plugin.ops.dsa import (
    dense_causal_attention,
    dense_causal_attention_reference,
    indexer_kl_loss,
    indexer_scores,
    indexer_topk,
    sparse_attention,
    sparse_attention_reference,
)
from tests.ops.dsa_cases import DTYPES, TOL, index_inputs, key_mask, loop_attention, qkv, rel, selection, visible


# ---- sparse attention -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_with_k_at_least_T_equals_dense_causal(dtype):
    q, k, v = qkv(dtype=dtype)
    T = q.shape[1]
    indices = indexer_topk(*index_inputs(dtype=dtype), topk=T + 3)
    assert indices.shape[-1] == T
    ref = loop_attention(q, k, v, 0.3, lambda b, t, s: s <= t)
    assert rel(sparse_attention(q, k, v, indices, 0.3, block_size=4), ref) < TOL[dtype]
    assert rel(dense_causal_attention(q, k, v, 0.3, block_size=4), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_equals_dense_masked_to_selection(dtype):
    q, k, v = qkv(dtype=dtype)
    indices = indexer_topk(*index_inputs(dtype=dtype), topk=5)
    ref = loop_attention(q, k, v, 0.5, selection(indices))
    for block, chunk in ((8, 8192), (3, 4), (64, 1)):  # one key chunk, several, one key at a time
        assert rel(sparse_attention(q, k, v, indices, 0.5, block_size=block, key_chunk=chunk), ref) < TOL[dtype]
    assert rel(sparse_attention_reference(q, k, v, indices, 0.5), ref) < TOL[dtype]


def test_unselected_key_changes_nothing():
    q, k, v = qkv(B=1, T=24)
    indices = indexer_topk(*index_inputs(B=1, T=24), topk=4)
    unused = sorted(set(range(24)) - set(indices[indices >= 0].tolist()))
    used = int(indices[0, -1, 0])
    assert unused, "the test needs a key nobody selected"
    out = sparse_attention(q, k, v, indices, 0.4, block_size=8)
    k2, v2 = k.clone(), v.clone()
    k2[:, unused] += 5.0
    v2[:, unused] -= 3.0
    assert torch.equal(sparse_attention(q, k2, v2, indices, 0.4, block_size=8), out)
    k2[:, used] += 1.0  # a selected key does matter
    assert not torch.allclose(sparse_attention(q, k2, v2, indices, 0.4, block_size=8), out)


def test_arbitrary_selection_with_empty_rows():
    q, k, v = qkv(B=2, T=9, S=13)
    g = torch.Generator().manual_seed(3)
    indices = torch.stack([torch.stack([torch.randperm(13, generator=g)[:4] for _ in range(9)]) for _ in range(2)])
    indices[:, ::3, 1:3] = -1
    indices[1, 4] = -1  # selects nothing: zeros out, no NaN
    ref = loop_attention(q, k, v, 0.7, selection(indices))
    out = sparse_attention(q, k, v, indices, 0.7, block_size=4)
    assert rel(out, ref) < 1e-12
    assert torch.all(out[1, 4] == 0)


def test_gradients_equal_autograd_through_reference():
    q, k, v = qkv(B=2, T=11, S=11, H=2, D=4, Dv=3, grad=True)
    indices = indexer_topk(*index_inputs(B=2, T=11), topk=4)
    indices[0, 5] = -1
    grad = torch.randn(2, 11, 2, 3, dtype=torch.float64)
    ours = torch.autograd.grad(sparse_attention(q, k, v, indices, 0.6, block_size=3), (q, k, v), grad)
    ref = torch.autograd.grad(sparse_attention_reference(q, k, v, indices, 0.6), (q, k, v), grad)
    for a, b in zip(ours, ref):
        assert rel(a, b) < 1e-12
    chunked = torch.autograd.grad(sparse_attention(q, k, v, indices, 0.6, block_size=4, key_chunk=3), (q, k, v), grad)
    for a, b in zip(chunked, ref):
        assert rel(a, b) < 1e-12
    assert torch.autograd.gradcheck(lambda *t: sparse_attention(*t, indices, 0.6, block_size=4), (q, k, v))
    assert torch.autograd.gradcheck(lambda *t: dense_causal_attention(*t, 0.6, block_size=4), (q, k, v))
    assert torch.autograd.gradcheck(lambda *t: dense_causal_attention(*t, 0.6, block_size=4, key_chunk=3), (q, k, v))


def test_saves_only_inputs_indices_output_and_lse():
    T, H, D, Dv = 64, 2, 4, 3
    q, k, v = qkv(B=1, T=T, H=H, D=D, Dv=Dv, dtype=torch.float32, grad=True)
    indices = indexer_topk(*index_inputs(B=1, T=T, dtype=torch.float32), topk=8)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        sparse_attention(q, k, v, indices, 0.5, block_size=8)
    # q, k, v, out, lse and the [T, 8] indices backward rebuilds its blocks from: nothing T x S
    assert sum(saved) == T * H * (D + D + Dv + Dv + 1) + T * 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_causal_with_offset_and_packing(dtype):
    q, k, v = qkv(B=1, T=5, S=12, dtype=dtype)
    ref = loop_attention(q, k, v, 0.3, lambda b, t, s: visible(t, s, offset=7))
    assert rel(dense_causal_attention(q, k, v, 0.3, query_offset=7, block_size=2), ref) < TOL[dtype]
    q, k, v = qkv(B=1, T=12, dtype=dtype)
    cu = [0, 3, 3, 8, 12]
    ref = loop_attention(q, k, v, 0.3, lambda b, t, s: visible(t, s, cu=cu))
    for chunk in (8192, 2):
        out = dense_causal_attention(q, k, v, 0.3, cu_seqlens=torch.tensor(cu), block_size=5, key_chunk=chunk)
        assert rel(out, ref) < TOL[dtype]
    assert rel(dense_causal_attention_reference(q, k, v, 0.3, cu_seqlens=torch.tensor(cu)), ref) < TOL[dtype]


# ---- bad input --------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument(monkeypatch):
    # value checks (index range, repeated keys, cu_seqlens' offsets) run only in debug mode, so it is on here
    monkeypatch.setenv("MOE_PLUGIN_DEBUG_CHECKS", "1")
    q, k, v = qkv(B=1, T=6, dtype=torch.float32)
    qi, ki, w = index_inputs(B=1, T=6, dtype=torch.float32)
    idx = indexer_topk(qi, ki, w, 2)
    cases = [
        (r"^q:", lambda: sparse_attention(q[0], k, v, idx, 0.1)),
        (r"^k:", lambda: sparse_attention(q, k[:, :, :2], v, idx, 0.1)),  # head mismatch
        (r"^k:", lambda: sparse_attention(q, k[..., :3], v, idx, 0.1)),  # dim mismatch
        (r"^v:", lambda: sparse_attention(q, k, v[:, :4], idx, 0.1)),
        (r"^dtype mismatch: q=torch.float32, k=torch.float64,", lambda: sparse_attention(q, k.double(), v, idx, 0.1)),
        (r"^scale:", lambda: sparse_attention(q, k, v, idx, -1.0)),
        (r"^indices: expected an int32/int64", lambda: sparse_attention(q, k, v, idx.float(), 0.1)),
        (r"^indices: expected key positions", lambda: sparse_attention(q, k, v, idx + 10, 0.1)),
        (
            r"^indices: .* selects a key twice",
            lambda: sparse_attention(q, k, v, torch.zeros(1, 6, 2, dtype=torch.long), 0.1),
        ),
        (r"^block_size:", lambda: sparse_attention(q, k, v, idx, 0.1, block_size=0)),
        (r"^key_chunk:", lambda: dense_causal_attention(q, k, v, 0.1, key_chunk=0)),
        (r"^topk:", lambda: indexer_topk(qi, ki, w, 0)),
        (r"^key_chunk:", lambda: indexer_topk(qi, ki, w, 2, key_chunk=-1)),
        (r"^q_index:", lambda: indexer_topk(qi[0], ki, w, 2)),
        (r"^k_index:", lambda: indexer_topk(qi, ki[..., :2], w, 2)),
        (r"^weights:", lambda: indexer_scores(qi, ki, w[..., :1])),
        (r"^dtype mismatch: q_index=torch.float32, k_index=torch.float64,", lambda: indexer_scores(qi, ki.double(), w)),
        (
            r"^cu_seqlens:",
            lambda: indexer_scores(
                qi.expand(2, -1, -1, -1), ki.expand(2, -1, -1), w.expand(2, -1, -1), cu_seqlens=torch.tensor([0, 6])
            ),
        ),
        (r"^cu_seqlens:", lambda: dense_causal_attention(q, k, v, 0.1, cu_seqlens=torch.tensor([0, 2, 5]))),
        (r"^query_offset:", lambda: dense_causal_attention(q, k, v, 0.1, query_offset=-1)),
        (r"^attn_probs:", lambda: indexer_kl_loss(torch.zeros(1, 6, 6), torch.zeros(1, 6, 5))),
        (r"^attn_probs:", lambda: indexer_kl_loss(torch.zeros(1, 6, 6), torch.zeros(1, 6, 6, dtype=torch.float64))),
    ]
    for pattern, call in cases:
        with pytest.raises(ValueError, match=pattern):
            call()


# ---- optional key mask (left-padded batches) ---------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 4])
def test_dense_causal_with_key_mask_equals_loop(offset):
    q, k, v = qkv(T=15, S=19)
    mask = key_mask()
    allowed = lambda b, t, s: visible(t, s, offset) and bool(mask[b, s])  # noqa: E731
    want = loop_attention(q, k, v, 0.3, allowed)
    for out in (
        dense_causal_attention(q, k, v, 0.3, query_offset=offset, key_mask=mask, block_size=4, key_chunk=5),
        dense_causal_attention_reference(q, k, v, 0.3, query_offset=offset, key_mask=mask),
    ):
        assert rel(out, want) <= 1e-12


def test_bad_key_mask_is_refused_by_name():
    q, k, v = qkv(T=6)
    qi, ki, w = index_inputs(T=6)
    for bad in (torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 6)):
        with pytest.raises(ValueError, match="^key_mask:"):
            dense_causal_attention(q, k, v, 0.3, key_mask=bad)
        with pytest.raises(ValueError, match="^key_mask:"):
            indexer_topk(qi, ki, w, 2, key_mask=bad)
