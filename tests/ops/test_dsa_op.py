"""DSA's sparse attention as the custom op ``moe_plugin::sparse_attention`` (moe_plugin/ops/dsa/sparse_op.py):
on ``meta`` with no stand-in (shapes, and the saved set autograd records), and under
``torch.compile(fullgraph=True)`` as opaque ops, against eager on the CPU."""

from __future__ import annotations

import torch

from moe_plugin.ops.dsa import indexer_topk, sparse_attention


def _inputs(B=1, T=16, H=2, D=4, Dv=3, Hi=2, Di=4, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_(True)  # noqa: E731
    q, k, v = mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, Dv)
    index = [torch.randn(*s, generator=g).to(device) for s in ((B, T, Hi, Di), (B, T, Di), (B, T, Hi))]
    return (q, k, v), index


def test_runs_on_meta_and_saves_q_k_v_indices_out_lse():
    """The planner's view: the real op on meta tensors (no patch), indices from the real top-k on meta; autograd
    saves q, k, v, the indices, out ``[B, T, H, Dv]`` and lse ``[B, T, H]``; backward gives q, k, v's shapes."""
    B, T, H, D, Dv, top = 2, 40, 3, 8, 5, 6
    (q, k, v), (qi, ki, w) = _inputs(B, T, H, D, Dv, device="meta")
    indices = indexer_topk(qi, ki, w, top)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = sparse_attention(q, k, v, indices, 0.5, block_size=8)
    assert out.is_meta and out.shape == (B, T, H, Dv)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(B, T, H, D), (B, T, H, D), (B, T, H, Dv), (B, T, top), (B, T, H, Dv), (B, T, H)])
    assert any(t is indices for t in saved)  # the indices themselves, no copy
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.is_meta


def test_compiles_as_one_graph_and_matches_eager():
    """fullgraph: dynamo traces the indexer's top-k and the attention op without a break (the block loop and
    its host-int spans run inside the op's eager kernels); output and gradients equal eager's."""
    (q, k, v), (qi, ki, w) = _inputs()

    def step(q, k, v, qi, ki, w):
        indices = indexer_topk(qi, ki, w, 4, block_size=8)
        return sparse_attention(q, k, v, indices, 0.3, block_size=8), indices

    want, want_idx = step(q, k, v, qi, ki, w)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    got, got_idx = torch.compile(step, fullgraph=True)(q, k, v, qi, ki, w)
    assert torch.equal(got_idx, want_idx)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    for mine, ref in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), want_grads):
        assert torch.allclose(mine, ref, atol=1e-6, rtol=1e-6)
