"""DSA's ops in the hot path (issue 24): how many host reads each call makes (counted by
moe_plugin/training/metrics/host_reads.py), value checks only in debug mode, and the read-free top-k tie rule
against a plain sort for every dtype."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moe_plugin.ops.dsa import (
    dense_causal_attention,
    dense_causal_attention_reference,
    indexer_kl_loss,
    indexer_scores,
    indexer_topk,
    sparse_attention,
    sparse_attention_reference,
)
from moe_plugin.ops.dsa.indexer import _topk_latest_on_ties
from moe_plugin.training.metrics.host_reads import count_host_reads


@pytest.fixture(autouse=True)
def _hot_path(monkeypatch):
    monkeypatch.delenv("MOE_PLUGIN_DEBUG_CHECKS", raising=False)


def _inputs(B=2, T=40, H=2, D=8, Hi=3, Di=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_(True)  # noqa: E731
    q, k, v = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, D)
    qi, ki, w = (torch.randn(*s, generator=g) for s in ((B, T, Hi, Di), (B, T, Di), (B, T, Hi)))
    return (q, k, v), (qi, ki, w)


def _reads(fn):
    with count_host_reads(nn.Identity()) as counts:
        fn()
    return counts.detail()


def _grads_match_reference(q, k, v, idx, **kw):
    for t in (q, k, v):
        t.grad = None
    out = sparse_attention(q, k, v, idx, 0.3, **kw)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = sparse_attention_reference(q, k, v, idx, 0.3)
    ref.square().sum().backward()
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for mine, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.allclose(mine, want, atol=1e-5, rtol=1e-5)


def test_sparse_attention_on_the_indexers_result_reads_nothing():
    """indexer_topk's result carries its queries' visible ranges: forward and backward over 5 blocks of
    queries take their key spans from them, with no read."""
    (q, k, v), (qi, ki, w) = _inputs()
    idx = indexer_topk(qi, ki, w, 6, block_size=16)
    got = _reads(lambda: sparse_attention(q, k, v, idx, 0.3, block_size=8).square().sum().backward())
    assert got == {}
    _grads_match_reference(q, k, v, idx, block_size=8)


def test_sparse_attention_on_other_indices_reads_its_spans_once_per_call():
    """Indices from elsewhere (a copy, or the indexer's result changed in place, here to a key it never
    selects: a later one) cost one read per call, for all blocks, forward and backward."""
    (q, k, v), (qi, ki, w) = _inputs()
    idx = indexer_topk(qi, ki, w, 6)
    copy = idx.clone()
    got = _reads(lambda: sparse_attention(q, k, v, copy, 0.3, block_size=8).square().sum().backward())
    assert got == {("trainer", "tolist"): 1}
    idx[:, 3, 0] = 39  # query 3's first slot: the last key, outside its visible range
    got = _reads(lambda: sparse_attention(q, k, v, idx, 0.3, block_size=8).square().sum().backward())
    assert got == {("trainer", "tolist"): 1}
    _grads_match_reference(q, k, v, idx, block_size=8)


def test_dense_attention_and_topk_read_nothing_without_packing():
    (q, k, v), (qi, ki, w) = _inputs()
    assert _reads(lambda: dense_causal_attention(q, k, v, 0.3, block_size=8).sum().backward()) == {}
    assert _reads(lambda: indexer_topk(qi, ki, w, 6, block_size=8, query_offset=0)) == {}
    qi_zero = -qi.abs()  # every score exactly 0: all keys tie, the tie rule runs on every row
    assert _reads(lambda: indexer_topk(qi_zero, ki.abs(), w, 6, block_size=8)) == {}


def test_packed_sequences_are_read_once_per_cu_seqlens_tensor():
    """The boundaries are read once per cu_seqlens tensor (the layers of a step share it), not per block or
    per call; a new tensor, or one changed in place, is read again."""
    (q, k, v), (qi, ki, w) = _inputs(B=1)
    cu = torch.tensor([0, 7, 19, 40])
    got = _reads(lambda: dense_causal_attention(q, k, v, 0.3, cu, block_size=8).sum().backward())
    assert got == {("trainer", "tolist"): 1}
    assert torch.allclose(
        dense_causal_attention(q, k, v, 0.3, cu, block_size=8),
        dense_causal_attention_reference(q, k, v, 0.3, cu),
        atol=1e-5,
    )
    assert _reads(lambda: indexer_topk(qi, ki, w, 6, cu, block_size=8)) == {}
    assert _reads(lambda: indexer_topk(qi, ki, w, 6, cu.clone(), block_size=8)) == {("trainer", "tolist"): 1}
    idx = indexer_topk(qi, ki, w, 6, cu, block_size=8)
    assert _reads(lambda: sparse_attention(q, k, v, idx, 0.3, block_size=8)) == {}
    _grads_match_reference(q, k, v, idx, block_size=8)
    cu[1] = 12  # in place: the kept copy is stale
    assert _reads(lambda: indexer_topk(qi, ki, w, 6, cu, block_size=8)) == {("trainer", "tolist"): 1}
    assert torch.allclose(
        dense_causal_attention(q, k, v, 0.3, cu, block_size=8),
        dense_causal_attention_reference(q, k, v, 0.3, cu),
        atol=1e-5,
    )


def test_value_checks_read_only_in_debug_mode(monkeypatch):
    (q, k, v), (qi, ki, w) = _inputs(B=1)
    idx = indexer_topk(qi, ki, w, 4)
    scores = indexer_scores(qi, ki, w)
    target = torch.softmax(scores, -1)
    assert _reads(lambda: indexer_kl_loss(scores, target, idx)) == {}
    monkeypatch.setenv("MOE_PLUGIN_DEBUG_CHECKS", "1")
    assert _reads(lambda: indexer_kl_loss(scores, target, idx)) == {("trainer", "__int__"): 2}  # aminmax
    with pytest.raises(ValueError, match=r"^indices: expected key positions"):
        sparse_attention(q, k, v, idx + 40, 0.3)
    with pytest.raises(ValueError, match=r"^indices: .* selects a key twice"):
        sparse_attention(q, k, v, torch.zeros(1, 40, 2, dtype=torch.long), 0.3)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected offsets from 0"):
        dense_causal_attention(q, k, v, 0.3, torch.tensor([0, 7, 39]))
    with pytest.raises(ValueError, match=r"^cu_seqlens: offsets must be non-decreasing"):
        indexer_topk(qi, ki, w, 4, torch.tensor([0, 9, 7, 40]))


def _plain_latest_topk(row, take):
    """The rule by a Python sort: highest score first, ties to the later key."""
    return sorted(sorted(range(len(row)), key=lambda s: (-row[s], -s))[:take])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_topk_tie_rule_equals_a_plain_sort(dtype):
    """Scores with many exact ties (0, repeated values, -0.0 against 0.0), negatives and -inf, in every dtype."""
    g = torch.Generator().manual_seed(3)
    scores = (torch.randint(-3, 4, (12, 30), generator=g).float() * 0.5).to(dtype)
    scores[0] = 0.0
    scores[1, ::2] = -0.0
    scores[2, :20] = -math.inf
    scores[3] = torch.randn(30, generator=g).to(dtype)
    for take in (1, 5, 12, 29):
        got = _topk_latest_on_ties(scores, take)
        for r in range(scores.shape[0]):
            row = [float(x) for x in scores[r]]
            assert sorted(got[r].tolist()) == _plain_latest_topk(row, take), (take, r)
