"""DSA ops against plain references written here: causal softmax loops, per-(t, s) index scores, torch.topk."""

import math

import pytest
import torch

from moe_plugin.ops.dsa import (
    attention_target,
    dense_causal_attention,
    dense_causal_attention_reference,
    indexer_kl_loss,
    indexer_scores,
    indexer_topk,
    sparse_attention,
    sparse_attention_reference,
)

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def qkv(B=2, T=19, S=None, H=3, D=8, Dv=5, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return mk(B, T, H, D), mk(B, S, H, D), mk(B, S, H, Dv)


def index_inputs(B=2, T=19, S=None, Hi=4, Di=6, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    return (
        torch.randn(B, T, Hi, Di, generator=g, dtype=dtype),
        torch.randn(B, S, Di, generator=g, dtype=dtype),
        torch.randn(B, T, Hi, generator=g, dtype=dtype),
    )


def visible(t, s, offset=0, cu=None):
    """Plain rule: key s is visible to query t iff it is not in the future and in the same packed sequence."""
    pos = offset + t
    if s > pos:
        return False
    if cu is not None:
        seq = lambda p: max(i for i in range(len(cu) - 1) if cu[i] <= p)  # noqa: E731
        return seq(s) == seq(pos)
    return True


def loop_attention(q, k, v, scale, allowed):
    """Per (b, t, h): softmax over the allowed keys, as plain Python loops over queries."""
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(k.shape[1]) if allowed(b, t, s)]
            if not keys:
                continue
            for h in range(H):
                scores = torch.stack([q[b, t, h] @ k[b, s, h] for s in keys]) * scale
                p = torch.softmax(scores, 0)
                out[b, t, h] = sum(p[i] * v[b, s, h] for i, s in enumerate(keys))
    return out


def selection(indices):
    sets = [[set(int(i) for i in row if i >= 0) for row in batch] for batch in indices]
    return lambda b, t, s: s in sets[b][t]


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


# ---- indexer ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_scores_equal_loop(dtype):
    qi, ki, w = index_inputs(B=1, T=7, S=10, dtype=dtype)
    cu = [0, 4, 10]
    for offset, cus in ((3, None), (0, cu), (2, cu)):
        out = indexer_scores(qi, ki, w, cu_seqlens=None if cus is None else torch.tensor(cus), query_offset=offset)
        for t in range(7):
            for s in range(10):
                want = sum(w[0, t, j] * torch.relu(qi[0, t, j] @ ki[0, s]) for j in range(qi.shape[2]))
                if visible(t, s, offset, cus):
                    assert abs(float(out[0, t, s] - want)) <= TOL[dtype] * (1 + abs(float(want)))
                else:
                    assert out[0, t, s] == -math.inf


@pytest.mark.parametrize("block,chunk", [(1, 4096), (4, 3), (64, 1)])
def test_topk_equals_torch_topk_on_dense_scores(block, chunk):
    qi, ki, w = index_inputs(B=2, T=17, dtype=torch.float64)
    dense = indexer_scores(qi, ki, w)
    for topk in (1, 5, 17, 40):
        ours = indexer_topk(qi, ki, w, topk, block_size=block, key_chunk=chunk)
        assert ours.dtype == torch.int64 and ours.shape == (2, 17, min(topk, 17))
        want = dense.topk(min(topk, 17), dim=-1).values
        got = torch.where(ours >= 0, dense.gather(-1, ours.clamp_min(0)), -math.inf)
        # as sets (ties compare equal): the chosen scores are exactly torch.topk's values
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
        for row in ours.flatten(0, 1):  # no key twice
            chosen = row[row >= 0]
            assert chosen.unique().numel() == chosen.numel()


def test_topk_respects_causality_and_packing():
    cu = [0, 5, 6, 14]
    for offset, S, cus in ((0, 14, cu), (4, 14, cu), (6, 20, None)):
        qi, ki, w = index_inputs(B=1, T=14 - offset if cus else 14, S=S, dtype=torch.float32)
        T = qi.shape[1]
        out = indexer_topk(
            qi, ki, w, 3, cu_seqlens=torch.tensor(cus) if cus else None, query_offset=offset, block_size=4
        )
        for t in range(T):
            chosen = [int(s) for s in out[0, t] if s >= 0]
            n_visible = sum(visible(t, s, offset, cus) for s in range(S))
            assert len(chosen) == min(3, n_visible)
            assert all(visible(t, s, offset, cus) for s in chosen)


# ---- indexer loss -----------------------------------------------------------------------------------------


def direct_kl(scores, target, keep=None):
    """KL(p || softmax(I)) per query written out, over `keep` keys (renormalised), averaged over queries."""
    B, T, S = scores.shape
    total = 0.0
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(S) if (keep is None or keep(b, t, s)) and scores[b, t, s] > -math.inf]
            p = target[b, t, keys] / target[b, t, keys].sum()
            logq = scores[b, t, keys] - torch.logsumexp(scores[b, t, keys], 0)
            total = total + sum(p[i] * (torch.log(p[i]) - logq[i]) for i in range(len(keys)) if p[i] > 0)
    return total / (B * T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_target_is_head_summed_normalised_softmax(dtype):
    q, k, _ = qkv(B=1, T=6, dtype=dtype)
    out = attention_target(q, k, 0.4)
    for t in range(6):
        heads = [
            torch.softmax(torch.stack([q[0, t, h] @ k[0, s, h] * 0.4 for s in range(t + 1)]), 0)
            for h in range(q.shape[2])
        ]
        want = sum(heads) / len(heads)
        assert rel(out[0, t, : t + 1], want) < TOL[dtype]
        assert torch.all(out[0, t, t + 1 :] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_loss_equals_direct_formula(dtype):
    q, k, _ = qkv(B=2, T=9, dtype=dtype)
    qi, ki, w = index_inputs(B=2, T=9, dtype=dtype)
    scores = indexer_scores(qi, ki, w)
    target = attention_target(q, k, 0.3)
    assert abs(float(indexer_kl_loss(scores, target) - direct_kl(scores, target))) < TOL[dtype]
    indices = indexer_topk(qi, ki, w, 3)
    got = indexer_kl_loss(scores, target, indices)
    assert abs(float(got - direct_kl(scores, target, selection(indices)))) < TOL[dtype]


def test_kl_loss_zero_when_distributions_match_and_gradient_finite():
    q, k, _ = qkv(B=1, T=8)
    target = attention_target(q, k, 0.3)
    scores = torch.log(target).requires_grad_(True)  # softmax(log p) = p; -inf where p = 0
    loss = indexer_kl_loss(scores, target)
    assert abs(loss.item()) < 1e-12
    loss.backward()
    assert torch.isfinite(scores.grad).all() and float(scores.grad.abs().max()) < 1e-12
    indices = indexer_topk(*index_inputs(B=1, T=8), topk=3)
    assert abs(indexer_kl_loss(scores, target, indices).item()) < 1e-12


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


def test_indexer_scores_gradients_equal_the_plain_formula():
    """The head-at-a-time autograd Function against autograd through the plain per-head einsum."""
    torch.manual_seed(5)
    q = torch.randn(2, 9, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: indexer_scores(*a).clamp_min(-1e9), (q, k, w))
    ref = torch.einsum("btj,btjs->bts", w, torch.relu(torch.einsum("btjd,bsd->btjs", q, k)))
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    ours = indexer_scores(q, k, w)
    assert torch.allclose(ours[:, causal], ref[:, causal]) and bool(torch.isinf(ours[:, ~causal]).all())


# ---- optional key mask (left-padded batches) ---------------------------------------------------------------


def key_mask(B=2, S=19, seed=2):
    """A random bool [B, S] mask with at least one real key per row."""
    mask = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[:, -1] = True
    return mask


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


def test_index_scores_and_topk_never_pick_masked_keys():
    qi, ki, w = index_inputs(T=19)
    mask = key_mask()
    scores = indexer_scores(qi, ki, w, key_mask=mask)
    plain = indexer_scores(qi, ki, w)
    for b in range(2):
        for t in range(19):
            for s in range(19):
                want = plain[b, t, s] if mask[b, s] else -math.inf
                assert scores[b, t, s] == want
    for topk in (3, 8):
        idx = indexer_topk(qi, ki, w, topk, key_mask=mask, block_size=5, key_chunk=4)
        for b in range(2):
            for t in range(19):
                chosen = sorted(int(i) for i in idx[b, t] if i >= 0)
                real = [s for s in range(t + 1) if mask[b, s]]
                best = sorted(real, key=lambda s: (-float(plain[b, t, s]), -s))[:topk]  # ties: latest
                assert chosen == sorted(best), (b, t)


def test_topk_ties_go_to_the_latest_keys():
    # all index scores exactly 0 (the ReLU of negative products): every key ties
    qi, ki, w = index_inputs(B=1, T=9)
    ki = ki.abs()
    qi = -qi.abs()
    idx = indexer_topk(qi, ki, w, 3, query_offset=0)
    for t in range(9):
        want = set(range(max(0, t - 2), t + 1))
        assert set(int(i) for i in idx[0, t] if i >= 0) == want, t


def test_attention_target_with_key_mask_puts_no_mass_on_masked_keys():
    q, k, _ = qkv(T=11)
    mask = key_mask(S=11)
    target = attention_target(q, k, 0.3, key_mask=mask)
    assert torch.all(target[~mask[:, None, :].expand_as(target)] == 0)
    has_key = (torch.tril(torch.ones(11, 11, dtype=torch.bool)) & mask[:, None, :]).any(-1)
    assert torch.allclose(target.sum(-1)[has_key], torch.ones(()).double())


def test_bad_key_mask_is_refused_by_name():
    q, k, v = qkv(T=6)
    qi, ki, w = index_inputs(T=6)
    for bad in (torch.ones(2, 5, dtype=torch.bool), torch.ones(2, 6)):
        with pytest.raises(ValueError, match="^key_mask:"):
            dense_causal_attention(q, k, v, 0.3, key_mask=bad)
        with pytest.raises(ValueError, match="^key_mask:"):
            indexer_topk(qi, ki, w, 2, key_mask=bad)
