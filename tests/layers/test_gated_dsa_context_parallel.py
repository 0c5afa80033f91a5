"""GatedMLAAttention under context parallelism equals one process on the whole row.

Each rank runs its contiguous slice of a packed row (gated_dsa_context_workers.py); the test process runs the
whole row on one process with the same seed and compares: the output slices, the input gradient, every
parameter gradient summed over the ranks, the indexer's top-k sets per query, and the indexer loss (the mean
over the ranks of their local means). All cases of one world size run in one launch.

Tolerance: fp32, norm-relative 1e-5. Both sides do the same math; only the order of sums differs (the slice's
matmuls, the gradient sums over ranks), which for these sizes stays near ``tests.tolerances.chain_rel`` of a
chain of a few hundred terms (about 1e-5; tests/tolerances.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_plugin.layers.gated_dsa import MLACache
from moe_plugin.testing.launch import resolve_function, run_distributed
from tests.context_cases import alone, check_refusals

WORKERS = Path(__file__).with_name("gated_dsa_context_workers.py")
REL = 1e-5
TOTAL = 48

# Document boundaries of the 48-token row (slices of 24 at CP 2, of 12 at CP 4; the gathered path's balanced
# pieces of 12 and 3):
PACKED = (0, 4, 18, 24, 40, 48)  # [0, 4) and [40, 48) shorter than a slice, 24 a slice start, [4, 18) cut at CP 4
CUT = (0, 10, 34, 48)  # [10, 34) cut by every slice boundary inside it
SPANNING = (0, 2, 46, 48)  # one document across all ranks, packed between two short ones
ONE = (0, TOTAL)  # the row is one document

CASES = [
    dict(name="dense_one_document", config=dict(use_indexer=False), offsets=ONE),
    dict(name="dense_packed", config=dict(use_indexer=False), offsets=PACKED),
    dict(name="dense_cut", config=dict(use_indexer=False, output_gate=False), offsets=CUT),
    # 4 heads divide over CP 2 and 4: the dense cases above attend head-parallel; 3 heads do not: the gather
    dict(name="dense_heads_not_dividing", config=dict(use_indexer=False, num_heads=3), offsets=PACKED),
    dict(name="sparse_packed", config=dict(index_topk=3), offsets=PACKED, loss=True),
    dict(name="sparse_cut", config=dict(index_topk=4), offsets=CUT, loss=True),
    dict(name="sparse_spanning", config=dict(index_topk=5), offsets=SPANNING, loss=True),
    dict(name="sparse_one_document", config=dict(index_topk=3), offsets=ONE, loss=True, seed=3),
    dict(name="sparse_without_loss", config=dict(index_topk=3), offsets=PACKED),
    dict(name="warmup_packed", config=dict(index_topk=3), offsets=PACKED, warmup=True, loss=True),
    dict(name="warmup_spanning", config=dict(index_topk=2), offsets=SPANNING, warmup=True, loss=True, seed=5),
    dict(name="warmup_without_loss", config=dict(index_topk=3), offsets=CUT, warmup=True),
]
for _case in CASES:
    _case["total"] = TOTAL
# a longer one-document row whose per-rank attention work is counted (the gathered path, re-laid out)
BALANCE = dict(name="balance", config=dict(use_indexer=False, num_heads=3), offsets=(0, 256), total=256)
CASES.append(BALANCE)


def gated_dsa_config(**kw):
    return resolve_function(f"{WORKERS}:config")(**kw)


def one_process(case):
    return resolve_function(f"{WORKERS}:one_process")(case)


def close(got, ref, what):
    err = float((got - ref).norm())
    assert err <= REL * float(ref.norm()), f"{what}: |diff| {err:.3g} vs |ref| {float(ref.norm()):.3g}"


def check(case, ranks):
    name = case["name"]
    ref = one_process(case)
    # head-parallel (no indexer, the heads dividing): two all-to-alls in the forward (q, k, v; the output)
    config = gated_dsa_config(**case["config"])
    by_heads = not config.use_indexer and config.num_heads % len(ranks) == 0
    # and the gathered path, its slice cutting into CP pieces: two too (its queries re-laid out; the output back)
    assert [r["exchanges"] for r in ranks] == [2] * len(ranks), name
    if not by_heads:  # the gathered latent is expanded a chunk at a time, never the keys up to the slice's end
        for r in ranks:
            assert r["expanded"] and max(r["expanded"]) <= r["key_chunk"] < r["end"], name
    total = case["total"]
    assert [(r["start"], r["end"]) for r in ranks] == [
        (i * total // len(ranks), (i + 1) * total // len(ranks)) for i in range(len(ranks))
    ]
    close(torch.cat([r["out"] for r in ranks], dim=1), ref["out"], f"{name} output")
    close(torch.cat([r["x_grad"] for r in ranks], dim=1), ref["x_grad"], f"{name} input gradient")
    for param, grad in ref["grads"].items():
        got = [r["grads"][param] for r in ranks]
        if grad is None:  # e.g. the indexer without its loss: no gradient, on every rank
            assert all(g is None for g in got), f"{name} {param}: a gradient where one process has none"
            continue
        assert all(g is not None for g in got), f"{name} {param}: a rank without gradient"
        close(torch.stack(got).sum(0), grad, f"{name} gradient of {param}")
    indexer_grads = [g for p, g in ref["grads"].items() if p.startswith("indexer.")]
    if case["config"].get("use_indexer", True):  # the indexer learns from its loss alone
        assert all((g is not None) == bool(case.get("loss")) for g in indexer_grads), name
    if ref["kl"] is None:
        assert all(r["kl"] is None for r in ranks)
    else:
        kl = torch.stack([r["kl"] for r in ranks]).mean()
        assert abs(float(kl - ref["kl"])) <= REL * abs(float(ref["kl"])), f"{name} indexer loss"
    if ref["topk"] is None:
        assert all(r["topk"] is None for r in ranks), f"{name}: top-k only on some side"
        return
    want = ref["topk"]
    got = {}
    for r in ranks:
        assert not set(got) & set(r["topk"]), f"{name}: a query attended on two ranks"
        got.update(r["topk"])
    assert got == want, f"{name}: top-k sets differ"
    k = case["config"]["index_topk"]
    assert any(len(s) == k for s in want.values()) and any(len(s) < k for s in want.values())  # bites, runs short


def check_balance(ranks):
    """Each rank's attention work (the FLOPs of the blocks it ran) within 10 % of the mean."""
    flops = [r["attention_flops"] for r in ranks]
    assert min(flops) > 0 and max(flops) <= 1.1 * sum(flops) / len(flops), flops


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_equals_one_process(world_size):
    results = run_distributed(f"{WORKERS}:run", world_size=world_size, timeout_s=300, cases=CASES)
    for i, case in enumerate(CASES):
        check(case, [rank[i] for rank in results])
    check_balance([rank[CASES.index(BALANCE)] for rank in results])


def test_context_of_one_rank_equals_no_context():
    case = dict(config=dict(index_topk=3), offsets=PACKED, loss=True, total=TOTAL)
    on_slice = resolve_function(f"{WORKERS}:on_slice")
    got, ref = on_slice(case, alone(TOTAL, PACKED)), one_process(case)
    close(got["out"], ref["out"], "output")
    close(got["x_grad"], ref["x_grad"], "input gradient")
    close(got["kl"], ref["kl"], "indexer loss")
    assert got["topk"] == ref["topk"]


def test_context_refuses_what_it_cannot_combine():
    build = resolve_function(f"{WORKERS}:build")
    check_refusals(build(dict(config={})), 32, MLACache())
