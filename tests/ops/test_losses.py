"""The one training-loss composition (ops.losses) against a per-token reference written out here: cross entropy
by log-softmax of each scored position, the indexer KL by its definition, the balance term as a plain sum."""

import math

import pytest
import torch

from moe_plugin.ops.dsa import indexer_kl_loss
from moe_plugin.ops.losses import balance_terms, causal_lm_loss, training_loss


def ce_reference(logits, labels, cu_seqlens=None, num_items=None):
    """Sum over positions t with a label at t+1 (not -100, not across a packed document boundary) of
    -log softmax(logits[t])[label[t+1]], over the scored count (or num_items)."""
    b, t, _ = logits.shape
    starts = set(cu_seqlens[1:-1].tolist()) if cu_seqlens is not None else set()
    total, count = 0.0, 0
    for row in range(b):
        for pos in range(t - 1):
            target = int(labels[row, pos + 1])
            if target == -100 or (pos + 1) in starts:
                continue
            row_logits = logits[row, pos].double()
            total += float(torch.logsumexp(row_logits, 0) - row_logits[target])
            count += 1
    return total / (count if num_items is None else num_items)


def kl_reference(scores, target):
    """mean over queries of sum_s p log(p / q), q = softmax of the scores; p = 0 adds nothing."""
    b, t, s = scores.shape
    total = 0.0
    for i in range(b):
        for j in range(t):
            q = torch.softmax(scores[i, j].double(), 0)
            total += sum(float(p) * math.log(float(p) / float(q[k])) for k, p in enumerate(target[i, j]) if p > 0)
    return total / (b * t)


def random_kl_inputs(b=1, t=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, t, t, generator=g)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, -math.inf)
    target = torch.rand(b, t, t, generator=g).masked_fill(~causal, 0.0)
    return scores, target / target.sum(-1, keepdim=True)


@pytest.mark.parametrize("packed,num_items", [(False, None), (True, None), (True, 7.0), (False, 11.0)])
def test_training_loss_matches_the_written_out_sum(packed, num_items):
    g = torch.Generator().manual_seed(0)
    b, t, v = (1, 9, 13) if packed else (2, 6, 13)
    logits = torch.randn(b, t, v, generator=g).to(torch.bfloat16)  # the CE upcasts to fp32
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, 2] = -100
    cu = torch.tensor([0, 4, 9]) if packed else None
    scores, target = random_kl_inputs()
    kl = indexer_kl_loss(scores, target)
    balance = torch.tensor([1.25, 0.75, 1.5])
    loss = training_loss(logits, labels, cu, num_items, kl, 0.3, balance, 0.1)
    expected = ce_reference(logits.float(), labels, cu, num_items) + 0.3 * kl_reference(scores, target) + 0.1 * 3.5
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert kl.item() == pytest.approx(kl_reference(scores, target), rel=1e-5)


def test_absent_terms_leave_the_token_loss_bitwise():
    g = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    bare = causal_lm_loss(logits, labels)
    assert torch.equal(training_loss(logits, labels), bare)
    assert torch.equal(training_loss(logits, labels, indexer_loss_coeff=5.0, balance_coeff=5.0), bare)
    # the composition is the plain sum, in this order: what both faces computed before it had one owner
    kl, balance = torch.tensor(0.37), torch.tensor([0.9, 1.1])
    assert torch.equal(
        training_loss(logits, labels, None, None, kl, 0.2, balance, 0.05), bare + 0.2 * kl + 0.05 * balance.sum()
    )


def test_balance_terms_only_when_every_layer_recorded_one():
    assert balance_terms([]) is None
    assert balance_terms([torch.tensor(1.0), None]) is None
    assert torch.equal(balance_terms([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))
