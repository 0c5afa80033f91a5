"""Attention over keys and values expanded from a latent one chunk at a time (ops/dsa/latent_attention.py)
against the plain form (the whole latent expanded, one masked softmax): dense causal with packed documents and
a query offset, queries in two runs of positions (a re-laid-out slice), sparse selections from the indexer's
top-k, the indexer loss's target; forward and every gradient (queries, latent, the expansion's parameters),
several chunks and blocks; which chunk's gradients are the last."""

import math

import pytest
import torch

from moe_plugin.ops.dsa import attention_target, indexer_topk, sparse_attention_reference
from moe_plugin.ops.dsa.latent_attention import (
    causal_plan,
    latent_attention,
    latent_attention_reference,
    latent_attention_target,
    selection_plan,
)
from tests.ops.dsa_cases import TOL, index_inputs, visible

H, C, R, D_NOPE, D_V = 3, 7, 3, 5, 4  # heads, latent width (C - R "c_kv" + R "rope"), key and value dims


class Expand(torch.nn.Module):
    """MLA's expansion shrunk: ``c_kv`` -> norm -> a linear -> per-head k_nope and v, the rope part shared."""

    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(C - R, generator=g, dtype=dtype))
        self.proj = torch.nn.Parameter(torch.randn(H * (D_NOPE + D_V), C - R, generator=g, dtype=dtype) * 0.5)

    def forward(self, latent):
        B, n, _ = latent.shape
        c, rope = latent.split([C - R, R], -1)
        c = c * torch.rsqrt(c.square().mean(-1, keepdim=True) + 1e-6) * self.norm
        kv = torch.nn.functional.linear(c, self.proj).view(B, n, H, D_NOPE + D_V)
        k_nope, v = kv.split([D_NOPE, D_V], -1)
        return torch.cat([k_nope, rope.unsqueeze(2).expand(B, n, H, R)], -1), v


def inputs(B, T, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D_NOPE + R, generator=g, dtype=dtype).requires_grad_()
    latent = torch.randn(B, S, C, generator=g, dtype=dtype).requires_grad_()
    return q, latent, torch.randn(B, T, H, D_V, generator=g, dtype=dtype)


def grads(fn, expand, q, latent, probe):
    for t in (q, latent, *expand.parameters()):
        t.grad = None
    out = fn()
    (out * probe).sum().backward()
    return [out.detach()] + [t.grad.clone() for t in (q, latent, *expand.parameters())]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def allowed_of(B, T, S, runs, cu=None):
    """``[B, T, S]`` by the plain visibility rule, query t of run (t0, t1, pos) at pos + t - t0."""
    cu = None if cu is None else [int(x) for x in cu]
    rows = []
    for t in range(T):
        pos = next(p + t - r0 for r0, r1, p in runs if r0 <= t < r1)
        rows.append([visible(pos, s, 0, cu) for s in range(S)])
    return torch.tensor(rows).expand(B, T, S)


CAUSAL = [
    # (B, T, S, runs, cu_seqlens, block, key_chunk)
    (2, 11, 11, [(0, 11, 0)], None, 4, 3),  # one process's row, the chunks not a multiple of anything
    (1, 8, 20, [(0, 8, 12)], (0, 3, 10, 15, 20), 3, 4),  # a slice at offset 12 of a packed row: a doc cut, one after
    (1, 10, 24, [(0, 5, 3), (5, 10, 19)], (0, 9, 24), 2, 5),  # two runs (a re-laid-out slice)
    (1, 6, 13, [(0, 6, 7)], (0, 2, 13), 64, 2048),  # one block, one chunk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CAUSAL)
def test_causal_equals_the_whole_latent_expanded(case, dtype):
    B, T, S, runs, cu, block, chunk = case
    cu = None if cu is None else torch.tensor(cu)
    expand = Expand(dtype)
    q, latent, probe = inputs(B, T, S, dtype)
    plan = causal_plan(S, runs, cu)
    got = grads(lambda: latent_attention(q, latent, expand, 0.4, plan, block, chunk), expand, q, latent, probe)
    allowed = allowed_of(B, T, S, runs, cu)
    want = grads(lambda: latent_attention_reference(q, latent, expand, 0.4, allowed), expand, q, latent, probe)
    names = ["output", "q", "latent", "norm", "proj"]
    for name, a, b in zip(names, got, want):
        assert rel(a, b) < TOL[dtype], name


def check_sparse(expand, q, latent, probe, indices, plan, block, chunk):
    """The output and every gradient of the sparse attention along ``plan`` against the whole latent expanded."""
    got = grads(lambda: latent_attention(q, latent, expand, 0.4, plan, block, chunk), expand, q, latent, probe)

    def reference():
        k, v = expand(latent)
        return sparse_attention_reference(q, k, v, indices, 0.4)

    for name, a, b in zip(["output", "q", "latent", "norm", "proj"], got, grads(reference, expand, q, latent, probe)):
        assert rel(a, b) < TOL[q.dtype], name


def test_sparse_equals_the_whole_latent_expanded():
    dtype, B, T, S, block, chunk = torch.float64, 2, 13, 13, 4, 5
    expand = Expand(dtype)
    q, latent, probe = inputs(B, T, S, dtype, seed=3)
    indices = indexer_topk(*index_inputs(B, T, S, dtype=dtype), topk=5, block_size=4)
    assert (indices < 0).any() and (indices >= 0).all(-1).any()  # some queries run short, some are full
    check_sparse(expand, q, latent, probe, indices, selection_plan(indices, S, block), block, chunk)


def test_the_expansions_gradients_come_chunk_by_chunk_the_last_marked():
    expand = Expand(torch.float32)
    q, latent, probe = inputs(1, 9, 9, torch.float32)
    calls, expanded = [], []

    def counting(x):
        expanded.append(x.shape[1])
        return expand(x)

    out = latent_attention(q, latent, counting, 0.4, causal_plan(9, [(0, 9, 0)]), 2, 4, grads_ready=calls.append)
    assert expanded == [4, 4, 1]  # the forward: each chunk once, never the whole latent
    (out * probe).sum().backward()
    assert expanded == [4, 4, 1] * 2 and calls == [False, False, True]


def test_target_equals_the_indexer_losss_target():
    dtype, T, S = torch.float64, 7, 15
    expand = Expand(dtype)
    q, latent, _ = inputs(1, T, S, dtype)
    cu = torch.tensor([0, 4, 15])
    got = latent_attention_target(q.detach(), latent.detach(), expand, 0.4, [(0, T, 8)], cu, key_chunk=4)
    k = expand(latent)[0].detach()
    want = attention_target(q.detach(), k, 0.4, cu, query_offset=8)
    assert rel(got, want) < TOL[dtype]
    assert math.isclose(float(got.sum()), T)


def test_refuses_what_it_cannot_use():
    expand = Expand(torch.float32)
    q, latent, _ = inputs(1, 4, 4, torch.float32)
    plan = causal_plan(4, [(0, 4, 0)])
    for kw, name in ((dict(block_size=0), "block_size"), (dict(key_chunk=-1), "key_chunk")):
        with pytest.raises(ValueError, match=name):
            latent_attention(q, latent, expand, 0.4, plan, **kw)
    with pytest.raises(ValueError, match="scale"):
        latent_attention(q, latent, expand, 0.0, plan)
    with pytest.raises(ValueError, match="latent"):
        latent_attention(q, latent[0], expand, 0.4, plan)


def test_sparse_over_runs_bounds_its_blocks_by_the_runs_visible_keys():
    """Queries in two runs of positions (a re-laid-out slice), each run's top-k its own: the blocks' spans from the
    runs (no read of the indices) give what the whole latent expanded gives."""
    dtype, T, S, block, chunk = torch.float64, 10, 24, 3, 5
    runs, cu = [(0, 5, 3), (5, 10, 19)], torch.tensor([0, 9, 24])
    expand = Expand(dtype)
    q, latent, probe = inputs(1, T, S, dtype, seed=4)
    q_i, k_i, w_i = index_inputs(1, T, S, dtype=dtype)
    indices = torch.cat(
        [indexer_topk(q_i[:, a:b], k_i, w_i[:, a:b], 4, cu, pos) for a, b, pos in runs], dim=1
    )  # fmt: skip
    check_sparse(expand, q, latent, probe, indices, selection_plan(indices, S, block, runs, cu), block, chunk)
