"""MoE ops against plain per-token loops written here (routing, dispatch, experts, combine, balancing)."""

import math

import pytest
import torch

from moe_plugin.ops.moe import (
    document_balance,
    document_balance_reference,
    document_weights,
    expert_load,
    grouped_glu,
    grouped_glu_reference,
    moe_forward,
    permute,
    quantile_balance_bias,
    route,
    sequence_aux_loss,
    unpermute,
    update_bias_sign,
)
from moe_plugin.ops.moe.grouped_mm import grouped_mm_supported


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def act_formula(kind, a, b):
    if kind == "situ":
        return (4 * torch.tanh(a / 4) * torch.sigmoid(a)) * (25 * torch.tanh(b / 25))
    return a * torch.sigmoid(a) * b


def choose_loop(logits_t, top_k, bias, num_groups=1, topk_groups=1):
    """One token's routing from the definition: (expert ids best first, unbiased scores)."""
    s = [1 / (1 + math.exp(-v)) for v in logits_t.tolist()]
    c = [si + (bias[i].item() if bias is not None else 0.0) for i, si in enumerate(s)]
    per = len(s) // num_groups
    group_score = [sum(sorted(c[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(num_groups)]
    groups = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
    eligible = [i for g in groups for i in range(g * per, (g + 1) * per)]
    return sorted(eligible, key=lambda i: -c[i])[:top_k], s


def moe_loop(x, router_w, bias, w1, w3, w2, top_k, kind):
    """For each token, for each chosen expert: weight * expert(x)."""
    out = torch.zeros_like(x)
    logits = x.double() @ router_w.double().t()
    for t in range(x.shape[0]):
        chosen, s = choose_loop(logits[t], top_k, bias)
        total = sum(s[e] for e in chosen)
        for e in chosen:
            h = act_formula(kind, w1[e] @ x[t], w3[e] @ x[t])
            out[t] += (s[e] / total) * (w2[e] @ h)
    return out


def make_experts(e, f, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(*shape, generator=g, dtype=dtype) / math.sqrt(shape[2])
        for shape in ((e, f, d), (e, f, d), (e, d, f))
    ]


ROUTINGS = {
    "balanced": (3, lambda e: torch.zeros(e)),
    "skewed": (3, lambda e: torch.linspace(0.6, -0.6, e)),
    "empty_expert": (3, lambda e: torch.zeros(e).index_fill_(0, torch.tensor([1, 4]), -10.0)),
    "all_to_one": (1, lambda e: torch.zeros(e).index_fill_(0, torch.tensor([5]), 10.0)),
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("kind", ["situ", "swiglu"])
def test_moe_forward_equals_token_loop(routing, kind):
    torch.manual_seed(0)
    n, d, f, e = 24, 16, 12, 8
    top_k, bias_fn = ROUTINGS[routing]
    bias = bias_fn(e)
    x = torch.randn(n, d)
    router_w = torch.randn(e, d) / 4
    w1, w3, w2 = make_experts(e, f, d)
    y, load = moe_forward(x, router_w, w1, w3, w2, top_k, bias=bias, activation=kind)
    assert rel(y, moe_loop(x, router_w, bias, w1, w3, w2, top_k, kind)) < 1e-5
    assert int(load.sum()) == n * top_k
    if routing == "empty_expert":
        assert load[1] == 0 and load[4] == 0
    if routing == "all_to_one":
        assert load[5] == n


@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (4, 1)])
@pytest.mark.parametrize("renormalize,scaling", [(True, 1.0), (False, 2.5)])
def test_route_equals_loop(groups, renormalize, scaling):
    torch.manual_seed(1)
    n, e, top_k = 20, 16, 3
    logits, bias = torch.randn(n, e), torch.randn(e) * 0.3
    weights, indices, scores = route(
        logits, top_k, bias=bias, renormalize=renormalize, scaling=scaling, num_groups=groups[0], topk_groups=groups[1]
    )
    assert weights.dtype == torch.float32 and indices.dtype == torch.int64 and scores.dtype == torch.float32
    assert rel(scores, torch.sigmoid(logits)) < 1e-7
    for t in range(n):
        chosen, s = choose_loop(logits[t], top_k, bias, *groups)
        assert indices[t].tolist() == chosen
        w = torch.tensor([s[i] for i in chosen], dtype=torch.float64)
        if renormalize:
            w = w / w.sum()
        assert rel(weights[t], w * scaling) < 1e-6


def test_group_limited_routing_stays_in_best_groups():
    torch.manual_seed(2)
    logits = torch.randn(50, 16)
    _, indices, _ = route(logits, 4, num_groups=4, topk_groups=2)
    assert all(len(set((indices[t] // 4).tolist())) <= 2 for t in range(50))


def test_permute_unpermute_round_trip_and_order():
    torch.manual_seed(3)
    n, d, e, k = 30, 8, 6, 3
    x = torch.randn(n, d)
    indices = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    x_sorted, tpe, order = permute(x, indices, e)
    flat = indices.reshape(-1)
    assert tpe.tolist() == [int((flat == i).sum()) for i in range(e)]
    assert torch.equal(flat[order], flat[order].sort().values)  # grouped by expert
    for i in range(e):  # stable: within an expert, token order
        slots = order[flat[order] == i]
        assert torch.equal(slots, slots.sort().values)
    assert torch.equal(x_sorted, x[order // k])
    weights = torch.rand(n, k)
    weights = weights / weights.sum(1, keepdim=True)
    assert rel(unpermute(x_sorted, order, weights), x) < 1e-6


def test_permute_unpermute_gradients():
    torch.manual_seed(4)
    n, d, e, k = 7, 5, 4, 2
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    indices = torch.stack([torch.randperm(e)[:k] for _ in range(n)])
    scale = torch.randn(n * k, 1, dtype=torch.float64)

    def f(x, w):
        x_sorted, _, order = permute(x, indices, e)
        return unpermute(x_sorted * scale, order, w)

    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("kind", ["situ", "swiglu"])
def test_grouped_glu_equals_reference_with_gradients(kind):
    torch.manual_seed(5)
    e, f, d = 6, 12, 8
    tpe = torch.tensor([5, 0, 9, 1, 0, 7])
    x = torch.randn(int(tpe.sum()), d, requires_grad=True)
    ws = [w.requires_grad_() for w in make_experts(e, f, d, seed=1)]
    assert grouped_mm_supported(x, ws[2])  # the fast path is really exercised
    y = grouped_glu(x, tpe, *ws, kind)
    y_ref = grouped_glu_reference(x, tpe, *ws, kind)
    assert rel(y, y_ref) < 1e-6
    # the reference itself against per-row math
    starts = [0] + torch.cumsum(tpe, 0).tolist()
    row = torch.stack(
        [
            ws[2][i] @ act_formula(kind, ws[0][i] @ x[r], ws[1][i] @ x[r])
            for i in range(e)
            for r in range(starts[i], starts[i + 1])
        ]
    )
    assert rel(y_ref, row) < 1e-6
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x] + ws, g)
    grads_ref = torch.autograd.grad(y_ref, [x] + ws, g)
    for a, b in zip(grads, grads_ref):
        assert rel(a, b) < 1e-5
    assert grads[1][1].abs().max() == 0  # an expert without tokens gets no gradient


def test_grouped_glu_unaligned_width_falls_back_correctly():
    torch.manual_seed(5)
    tpe = torch.tensor([2, 0, 3])
    x = torch.randn(5, 6)
    ws = make_experts(3, 5, 6, seed=3)  # 5 and 6 floats are not 16-byte strides: no grouped matmul
    assert not grouped_mm_supported(x, ws[2])
    row = torch.stack(
        [
            ws[2][i] @ act_formula("situ", ws[0][i] @ x[r], ws[1][i] @ x[r])
            for i, r in [(0, 0), (0, 1), (2, 2), (2, 3), (2, 4)]
        ]
    )
    assert rel(grouped_glu(x, tpe, *ws, "situ"), row) < 1e-6


def test_grouped_glu_bf16_close_to_fp32():
    torch.manual_seed(6)
    tpe = torch.tensor([4, 3, 0, 9])
    x = torch.randn(16, 32)
    ws = make_experts(4, 24, 32, seed=2)
    y32 = grouped_glu(x, tpe, *ws, "situ")
    y16 = grouped_glu(x.bfloat16(), tpe, *[w.bfloat16() for w in ws], "situ")
    assert y16.dtype == torch.bfloat16 and rel(y16.float(), y32) < 3e-2


def test_update_bias_sign_formula_and_balance():
    bias = torch.tensor([0.1, 0.0, -0.2, 0.0])
    load = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    assert torch.allclose(update_bias_sign(bias, load, 0.01), bias + 0.01 * torch.tensor([-1.0, 1, 1, 1]))
    torch.manual_seed(7)
    e, k = 16, 2
    logits = torch.randn(2000, e) * 0.5 + torch.linspace(1.5, -1.5, e)  # strongly skewed toward low ids
    bias = torch.zeros(e)
    before = imbalance(logits, bias, k)
    for _ in range(60):
        _, idx, _ = route(logits, k, bias=bias)
        bias = update_bias_sign(bias, expert_load(idx, e), 0.02)
    assert imbalance(logits, bias, k) < 0.5 * before


def imbalance(logits, bias, k):
    _, idx, _ = route(logits, k, bias=bias)
    load = expert_load(idx, logits.shape[1]).float()
    return (load.max() / load.mean()).item() - 1


def test_quantile_balance_definition_and_balance():
    torch.manual_seed(8)
    m, e, k = 400, 10, 3
    logits = torch.randn(m, e) + torch.linspace(1.5, -1.5, e)
    bias = torch.randn(e) * 0.05
    scores = torch.sigmoid(logits)
    new = quantile_balance_bias(scores, bias, k)
    # definition, as a loop
    q = (m * k) // e
    cut = [sorted((scores[t] + bias).tolist(), reverse=True)[k] for t in range(m)]
    want = torch.tensor([-sorted([scores[t, i].item() - cut[t] for t in range(m)], reverse=True)[q] for i in range(e)])
    assert rel(new, want - want.mean()) < 1e-6
    assert abs(new.mean().item()) < 1e-6
    assert imbalance(logits, new, k) < 0.3 * imbalance(logits, bias, k)


def test_sequence_aux_loss_equals_formula():
    torch.manual_seed(9)
    b, t, e, k, alpha = 3, 11, 6, 2, 0.01
    scores = torch.rand(b, t, e, requires_grad=True)
    indices = torch.stack([torch.stack([torch.randperm(e)[:k] for _ in range(t)]) for _ in range(b)])
    loss = sequence_aux_loss(scores, indices, alpha)
    total = 0.0
    for s in range(b):
        for i in range(e):
            count = sum(int(i in indices[s, u].tolist()) for u in range(t))
            p = sum((scores[s, u, i] / scores[s, u].sum()).item() for u in range(t)) / t
            total += alpha * (e / (k * t)) * count * p
    assert abs(loss.item() - total / b) < 1e-6 * max(1.0, abs(total))
    loss.backward()
    assert scores.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: route(torch.randn(4, 8), 9), "top_k"),
        (lambda: route(torch.randn(8), 2), "logits"),
        (lambda: route(torch.randn(4, 8), 2, bias=torch.zeros(7)), "bias"),
        (lambda: route(torch.randn(4, 8), 2, num_groups=3), "num_groups"),
        (lambda: route(torch.randn(4, 8), 2, num_groups=2, topk_groups=3), "topk_groups"),
        (lambda: route(torch.randn(4, 8), 5, num_groups=4, topk_groups=1), "top_k"),
        (lambda: permute(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), 3), "indices"),
        (lambda: permute(torch.randn(4, 8), torch.full((4, 2), 3), 3), "indices"),
        (lambda: unpermute(torch.randn(8, 5), torch.arange(8), torch.rand(3, 2)), "weights"),
        (lambda: grouped_glu(torch.randn(7, 8), torch.tensor([3, 3]), *make_experts(2, 4, 8)), "tokens_per_expert"),
        (lambda: grouped_glu(torch.randn(6, 8), torch.tensor([3, 3, 0]), *make_experts(2, 4, 8)), "tokens_per_expert"),
        (
            lambda: grouped_glu(
                torch.randn(6, 8), torch.tensor([3, 3]), *make_experts(2, 4, 8)[:2], torch.randn(2, 8, 5)
            ),
            "w2",
        ),
        (
            lambda: grouped_glu(
                torch.randn(6, 8),
                torch.tensor([3, 3]),
                make_experts(2, 4, 8)[0],
                torch.randn(2, 5, 8),
                make_experts(2, 4, 8)[2],
            ),
            "w3",
        ),
        (lambda: grouped_glu(torch.randn(6, 7), torch.tensor([3, 3]), *make_experts(2, 4, 8)), "w1"),
        (lambda: grouped_glu(torch.randn(6, 8), torch.tensor([3, 3]), *make_experts(2, 4, 8), "gelu"), "activation"),
        (lambda: quantile_balance_bias(torch.rand(5, 4), torch.zeros(4), 4), "top_k"),
        (lambda: quantile_balance_bias(torch.rand(5, 4), torch.zeros(3), 2), "bias"),
        (lambda: update_bias_sign(torch.zeros(4), torch.ones(3), 0.1), "load"),
        (lambda: sequence_aux_loss(torch.rand(2, 3, 4), torch.zeros(2, 4, 1, dtype=torch.long), 0.1), "indices"),
        (lambda: expert_load(torch.tensor([[0, 5]]), 3), "indices"),
        (lambda: expert_load(torch.tensor([[0, -1]]), 3), "indices"),
        (lambda: expert_load(torch.tensor([[0.0, 1.0]]), 3), "indices"),
        (lambda: sequence_aux_loss(torch.rand(2, 3, 4), torch.full((2, 3, 1), 4), 0.1), "indices"),
        (lambda: sequence_aux_loss(torch.rand(2, 3, 4), torch.full((2, 3, 1), -1), 0.1), "indices"),
        (lambda: sequence_aux_loss(torch.rand(2, 3, 4), torch.zeros(2, 3, 1), 0.1), "indices"),
        (lambda: unpermute(torch.randn(8, 5), torch.arange(8) + 1, torch.rand(4, 2)), "order"),
        (lambda: unpermute(torch.randn(8, 5), torch.arange(8.0), torch.rand(4, 2)), "order"),
        (lambda: update_bias_sign(torch.zeros(4), torch.ones(4), "a"), "rate"),
        (lambda: update_bias_sign(torch.zeros(4), torch.ones(4), -0.1), "rate"),
        (lambda: moe_forward(torch.randn(4, 8), torch.randn(5, 8), *make_experts(4, 6, 8), 2), "router_weight"),
    ],
)
def test_bad_input_names_the_argument(call, name, monkeypatch):
    # the id range checks (permute's, unpermute's) run only in debug mode, so it is on here
    monkeypatch.setenv("MOE_PLUGIN_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=f"^{name}:"):
        call()


def _balance_from_formula(scores, indices, doc_ids, num_docs):
    """Per document d, from DeepSeek-V3's definition, in plain Python: with T_d its counted tokens,
    f_i = E / (k T_d) * (choices of expert i in d) and P_i = (1 / T_d) sum_t s_ti / sum_j s_tj; sum_i f_i P_i."""
    n, e = scores.shape
    k = indices.shape[1]
    out = []
    for d in range(num_docs):
        tokens = [t for t in range(n) if int(doc_ids[t]) == d]
        if not tokens:
            out.append(0.0)
            continue
        total = 0.0
        for i in range(e):
            chosen = sum(1 for t in tokens if i in indices[t].tolist())
            p = sum(float(scores[t, i]) / float(scores[t].sum()) for t in tokens) / len(tokens)
            total += e / (k * len(tokens)) * chosen * p
        out.append(total)
    return torch.tensor(out, dtype=torch.float64)


def test_document_balance_equals_the_formula_per_document():
    """Documents of unequal length (1, 7, 0 and 13 tokens), padding tokens (-1) that must not count, choices made
    with a selection bias (so not the top scores): the fast op, its loop reference and the formula agree."""
    torch.manual_seed(21)
    e, k = 6, 2
    doc_ids = torch.tensor([0] + [1] * 7 + [3] * 13 + [-1] * 4)
    n = doc_ids.numel()
    logits = torch.randn(n, e, requires_grad=True)
    _, indices, scores = route(logits, k, bias=torch.randn(e))
    got = document_balance(scores, indices, doc_ids, 4)
    want = _balance_from_formula(scores.detach(), indices, doc_ids, 4)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-7), (got, want)
    assert torch.allclose(document_balance_reference(scores, indices, doc_ids, 4), got, rtol=1e-6, atol=1e-7)
    assert got[2] == 0  # the empty document
    # padding changes nothing: the same tokens without the padded ones
    real = doc_ids >= 0
    assert torch.allclose(document_balance(scores[real], indices[real], doc_ids[real], 4), got, rtol=1e-6)
    (got * torch.tensor([0.1, 0.2, 0.3, 0.4])).sum().backward()
    assert logits.grad[real].abs().sum() > 0 and torch.count_nonzero(logits.grad[~real]) == 0


def test_document_balance_of_evenly_used_experts_is_one():
    e, t = 4, 8
    indices = torch.tensor([[0, 1], [2, 3]] * (t // 2))  # top-2
    scores = torch.full((t, e), 0.5)
    assert torch.allclose(document_balance(scores, indices, torch.zeros(t, dtype=torch.long), 1), torch.ones(1))


def test_document_weights_count_the_scored_labels_of_each_document():
    """A label is scored when it is not -100 and not its document's first token (causal_lm_loss)."""
    labels = torch.tensor([[5, 6, -100, 7, 8, 9, -100, -100, 4, 4]])
    cu = torch.tensor([0, 3, 8, 8, 10])
    doc_ids, weights = document_weights(labels, cu)
    assert doc_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 3, 3]
    assert weights.tolist() == pytest.approx([1 / 4, 2 / 4, 0.0, 1 / 4])  # 1, 2, 0, 1 scored of 4
    _, weights = document_weights(labels, cu, num_items=2.0)
    assert weights.tolist() == pytest.approx([0.5, 1.0, 0.0, 0.5])
    rows, weights = document_weights(torch.tensor([[1, 2, 3], [-100, 2, -100]]))  # no cu_seqlens: one per row
    assert rows.tolist() == [0, 0, 0, 1, 1, 1] and weights.tolist() == pytest.approx([2 / 3, 1 / 3])


@pytest.mark.parametrize(
    "call,name",
    [
        (
            lambda: document_balance(torch.rand(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.tensor([0, 1, 2]), 2),
            "doc_ids",
        ),
        (lambda: document_balance(torch.rand(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.zeros(2), 1), "doc_ids"),
        (lambda: document_weights(torch.zeros(1, 4, dtype=torch.long), torch.tensor([0, 2, 3])), "cu_seqlens"),
    ],
)
def test_document_balance_refuses_bad_arguments(call, name, monkeypatch):
    # the document-id range and cu_seqlens' offsets are value checks: debug mode only
    monkeypatch.setenv("MOE_PLUGIN_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=name):
        call()
