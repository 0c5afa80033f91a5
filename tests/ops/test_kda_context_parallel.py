"""KDA under context parallelism equals one process on the whole row: the chunked op (ops/kda/context_parallel.py),
the short convolution (ops/conv.py causal_conv1d_context) and the KDA layer, forward and every input gradient
(and the layer's parameter gradients summed over the ranks), at CP 2 and 4 on gloo, one launch per world size.
The rows cut documents across rank boundaries, pack documents shorter than a slice, and hold one document
across all ranks; the exchange's bytes per rank do not grow with the row.

Tolerance: fp32, norm-relative 1e-5. Both sides run the same chunk math; the split only changes the order of
a few sums (the fold of the predecessors' pairs against the sequential state), near
``tests.tolerances.chain_rel`` of a chain of a few hundred terms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_plugin.layers.kda import KDACache
from moe_plugin.testing.launch import resolve_function, run_distributed
from tests.context_cases import alone, check_refusals

WORKERS = Path(__file__).with_name("kda_context_workers.py")
REL = 1e-5

# Document boundaries of a 24-token row (slices of 12 at CP 2, of 6 at CP 4):
PACKED = (0, 2, 9, 12, 20, 24)  # [0, 2) and [20, 24) shorter than a slice, 12 a slice start, [2, 9) cut at CP 4
CUT = (0, 5, 17, 24)  # [5, 17) cut by every slice boundary inside it
SPANNING = (0, 1, 23, 24)  # one document across all ranks, packed between two short ones
ONE = (0, 24)

CASES = [
    dict(name="kda_one_document", op="kda", offsets=ONE, chunk=4),
    dict(name="kda_one_document_batch_2", op="kda", offsets=ONE, chunk=4, batch=2, seed=1),
    dict(name="kda_packed", op="kda", offsets=PACKED, chunk=4, seed=2),
    dict(name="kda_cut", op="kda", offsets=CUT, chunk=4, seed=3),
    dict(name="kda_spanning", op="kda", offsets=SPANNING, chunk=4, seed=4),
    dict(name="kda_spanning_odd_chunks", op="kda", offsets=SPANNING, chunk=5, seed=5),
    dict(name="kda_chunk_longer_than_slice", op="kda", offsets=CUT, chunk=64, seed=6),
    dict(name="kda_spanning_long", op="kda", offsets=(0, 1, 47, 48), chunk=4, seed=7),
    # the context path in windows of 1 and 2 chunks (chunk.run_chunks): a slice's documents span windows
    dict(name="kda_packed_windows", op="kda", offsets=PACKED, chunk=2, seed=8, window=1),
    dict(name="kda_spanning_windows", op="kda", offsets=(0, 1, 47, 48), chunk=4, seed=9, window=2),
    dict(name="kda_cut_windows", op="kda", offsets=CUT, chunk=2, batch=1, seed=10, window=2),
    dict(name="kda_one_document_batch_2_windows", op="kda", offsets=ONE, chunk=2, batch=2, seed=11, window=1),
    dict(name="conv_one_document", op="conv", offsets=ONE, width=4),
    dict(name="conv_packed", op="conv", offsets=PACKED, width=4, seed=1),
    dict(name="conv_cut", op="conv", offsets=CUT, width=4, batch=1, seed=2),
    dict(name="conv_batch_2", op="conv", offsets=ONE, width=4, batch=2, seed=3),
    # slices of 4 and 2: the window reaches past the previous rank, and past a document start
    dict(name="conv_history_over_ranks", op="conv", offsets=(0, 1, 8), width=4, seed=4, total=8),
    dict(name="conv_spanning_long", op="conv", offsets=(0, 1, 47, 48), width=4, seed=5),
    dict(name="layer_packed", op="layer", offsets=PACKED, chunk=4),
    dict(name="layer_cut", op="layer", offsets=CUT, chunk=16, seed=1),
    dict(name="layer_spanning", op="layer", offsets=SPANNING, chunk=4, seed=2),
    dict(name="layer_spanning_long", op="layer", offsets=(0, 1, 47, 48), chunk=4, seed=2),
]
for _case in CASES:
    _case.setdefault("total", _case["offsets"][-1])


def close(got, ref, what):
    err = float((got - ref).norm())
    assert err <= REL * float(ref.norm()), f"{what}: |diff| {err:.3g} vs |ref| {float(ref.norm()):.3g}"


def check(case, ranks):
    name, total = case["name"], case["total"]
    ref = resolve_function(f"{WORKERS}:one_process")(case)
    size = len(ranks)
    slices = [(i * total // size, (i + 1) * total // size) for i in range(size)]
    assert [(r["start"], r["end"]) for r in ranks] == slices
    close(torch.cat([r["out"] for r in ranks], dim=1), ref["out"], f"{name} output")
    for param, grad in ref["grads"].items():
        if param in ("weight", "bias") or param.startswith("param."):  # whole on every rank: summed
            got = torch.stack([r["grads"][param] for r in ranks]).sum(0)
        else:  # a slice of the row on each rank
            got = torch.cat([r["grads"][param] for r in ranks], dim=1)
        assert float(grad.norm()) > 0, f"{name} {param}: the reference has no gradient to compare"
        close(got, grad, f"{name} gradient of {param}")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_equals_one_process(world_size):
    results = run_distributed(f"{WORKERS}:run", world_size=world_size, timeout_s=300, cases=CASES)
    by_name = {}
    for i, case in enumerate(CASES):
        ranks = [rank[i] for rank in results]
        check(case, ranks)
        by_name[case["name"]] = [r["bytes_sent"] for r in ranks]
    # The exchange per rank and call: KDA's prefix scan sends one (A, b) pair per sequence and head (fp32,
    # K x (K + V)) in each of log2(world) rounds, then the state b (K x V); its backward one pair to the rank
    # before and the adjoint scan's rounds; the conv the last min(W-1, L) inputs; twice the row, the same bytes.
    batch, heads, key, value = 1, 2, 4, 3
    rounds = world_size.bit_length() - 1

    def scan(batch):
        pair, state = batch * heads * key * (key + value) * 4, batch * heads * key * value * 4
        return [pair] * rounds + [state] + [pair] * (1 + rounds)

    assert by_name["kda_spanning"] == [scan(batch)] * world_size
    assert by_name["kda_one_document_batch_2"] == [scan(2)] * world_size
    assert by_name["kda_spanning_long"] == by_name["kda_spanning"]
    assert by_name["conv_spanning_long"] == by_name["conv_cut"] == [[3 * 5 * 4]] * world_size
    assert by_name["layer_spanning_long"] == by_name["layer_spanning"]
    assert len(by_name["layer_spanning"][0]) == 1 + len(scan(1))  # the three convolutions' inputs, then the scan


@pytest.mark.parametrize("name", ["kda_packed", "conv_packed", "layer_cut"])
def test_context_of_one_rank_equals_no_context(name):
    case = next(c for c in CASES if c["name"] == name)
    got = resolve_function(f"{WORKERS}:on_slice")(case, alone(case["total"], case["offsets"]))
    check(case, [{"start": 0, "end": case["total"], **got}])


def test_context_refuses_what_it_cannot_combine():
    attn = resolve_function(f"{WORKERS}:layer")(dict(chunk=4))
    check_refusals(attn, 16, KDACache())
