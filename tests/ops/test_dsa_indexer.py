"""DSA's lightning indexer against plain references (tests/ops/dsa_cases.py): per-(t, s) index scores and their
gradients, torch.topk on the dense scores (causality, packing, key masks, ties to the latest keys), the
attention target and the KL loss against the direct formula."""

import math

import pytest
import torch

from moe_plugin.ops.dsa import attention_target, indexer_kl_loss, indexer_scores, indexer_topk
from tests.ops.dsa_cases import DTYPES, TOL, index_inputs, key_mask, qkv, rel, selection, visible


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
