"""Subprocess side of test_dsa_triton.py: DSA's Triton sparse-attention kernels (moe_plugin/ops/dsa/sparse_triton.py)
under Triton's interpreter on CPU tensors, against ``sparse_attention_reference`` (autograd through it for the
gradients) and the blocked CPU pair. Run with ``TRITON_INTERPRET=1`` in the environment (read when
``triton.jit`` decorates, so before the kernel module is imported). Nothing here asserts: it prints one JSON
object, ``{case: {quantity: error}}``, each error ``max |ours - ref| / max(1, max |ref|)``, plus ``"exact"``
checks (where ``-inf``/zeros must match exactly) as booleans; the test compares.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from moe_plugin.ops.dsa import indexer_topk, sparse_attention
from moe_plugin.ops.dsa import sparse_op
from moe_plugin.ops.dsa import sparse_triton as st
from moe_plugin.ops.dsa.attention import blocked_backward, blocked_forward, sparse_attention_reference

B, T, S, H, DQK, DV, TOPK = 2, 40, 48, 2, 24, 16, 8
SCALE = DQK**-0.5


def err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / max(1.0, float(ref.abs().max())))


def random_indices(g: torch.Generator, topk: int) -> torch.Tensor:
    """Distinct keys per query, about a quarter of the slots ``-1``, query 5 of batch 0 without any key."""
    rows = [torch.randperm(S, generator=g)[:topk] for _ in range(B * T)]
    idx = torch.stack(rows).reshape(B, T, topk)
    idx = torch.where(torch.rand(B, T, topk, generator=g) < 0.25, -1, idx)
    idx[0, 5] = -1
    return idx


def compare(q, k, v, idx, dtype=torch.float32) -> dict:
    """The kernels (out, lse, dq, dk, dv) against the reference (in fp64) and the blocked pair (in q's dtype)."""
    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], generator=g).to(dtype)
    out, lse = st.sparse_attention_triton(q, k, v, idx, SCALE)
    dq, dk, dv = st.sparse_attention_triton_backward(grad_out, q, k, v, idx, out, lse, SCALE)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = sparse_attention_reference(*leaves, idx, SCALE)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    plan = sparse_op._selection_plan(idx, 16, k.shape[1])  # blocks of 16 queries: several per row
    b_out, b_lse = blocked_forward(q, k, v, SCALE, 16, 8192, plan)
    b_grads = blocked_backward(grad_out, q, k, v, b_out, b_lse, SCALE, 16, 8192, plan)
    empty = (idx < 0).all(-1)  # [B, T]: queries without a key
    res = {"out": err(out, ref), "out_blocked": err(out, b_out)}
    res["lse_blocked"] = err(torch.where(empty[..., None], 0, lse), torch.where(empty[..., None], 0, b_lse))
    for name, mine, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, b_grads):
        res[name], res[name + "_blocked"] = err(mine, r), err(mine, b)
    res["exact"] = bool(
        out.dtype == b_out.dtype == q.dtype
        and lse.dtype == b_lse.dtype
        and (dq.dtype, dk.dtype, dv.dtype) == (q.dtype, k.dtype, v.dtype)
        and torch.equal(torch.isneginf(lse), empty[..., None].expand_as(lse))
        and bool((out[empty] == 0).all())
        and bool((dq[empty] == 0).all())
    )
    res["empty_queries"] = int(empty.sum())
    return res


def cases() -> dict:
    g = torch.Generator().manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q, k, v = mk(B, T, H, DQK), mk(B, S, H, DQK), mk(B, S, H, DV)
    idx = random_indices(g, TOPK)
    results = {"random_int64": compare(q, k, v, idx)}
    # several tiles of index slots per query: the online softmax across tiles
    st._MAX_BLOCK_N, wide = 16, random_indices(g, 24)
    results["topk24_tiles16"] = compare(q, k, v, wide)
    st._MAX_BLOCK_N = 64
    # causal indices as the indexer makes them (queries 0..topk-2 see fewer than topk keys: -1 slots), int32
    kc, vc = k[:, :T], v[:, :T]
    causal = indexer_topk(mk(B, T, 2, 8), mk(B, T, 8), mk(B, T, 2).abs(), TOPK, block_size=16)
    results["causal_int32"] = compare(q, kc, vc, causal.int())
    # non-contiguous q, k, v (strided views of larger tensors) and int32 indices
    q_nc = mk(B, H, T, DQK + 3).transpose(1, 2)[..., 1 : DQK + 1]
    k_nc = mk(B, S, H, 2 * DQK)[..., ::2]
    v_nc = mk(B, H, S, DV).transpose(1, 2)
    results["noncontiguous_int32"] = compare(q_nc, k_nc, v_nc, idx.int())
    # fp16: the saved lse is fp16, the backward recomputes it in fp32 (RECOMPUTE_LSE)
    half = compare(*(x.half() for x in (q, k, v)), idx, dtype=torch.float16)
    results["fp16"] = {key: half[key] for key in ("out", "dq", "dk", "dv", "exact")}
    return results


def through_the_op() -> dict:
    """``sparse_attention`` (the custom op and its autograd) with ``gpu_kernel`` answering as it does for CUDA
    tensors: the op's kernels must call the Triton pair and agree with the reference."""
    calls = []

    def as_on_cuda(module, attr, *tensors):
        calls.append(attr)
        return getattr(__import__(module, fromlist=[attr]), attr)

    sparse_op.gpu_kernel = as_on_cuda
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, n, H, d, generator=g).requires_grad_() for n, d in ((T, DQK), (S, DQK), (S, DV)))
    idx = random_indices(g, TOPK)
    out = sparse_attention(q, k, v, idx, SCALE, block_size=16)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = sparse_attention_reference(q, k, v, idx, SCALE)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    res = {"out": err(out, ref), **{n: err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, ref_grads)}}
    res["calls"] = calls
    return res


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    start = time.perf_counter()
    report = {"cases": cases(), "op": through_the_op(), "seconds": time.perf_counter() - start}
    json.dump(report, sys.stdout)
