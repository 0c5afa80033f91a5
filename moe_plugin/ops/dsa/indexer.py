"""DeepSeek-V3.2's lightning indexer: per-query scores over the keys, and the top-k keys it selects.

``I[t, s] = sum_j w[t, j] * ReLU(q[t, j] . k[s])``, ``-inf`` where key ``s`` is not visible to query ``t``
(see ``masks``) or is masked out by the optional ``key_mask`` (padding: never selected). Any scaling (V3.2 multiplies
``w`` by ``H_I^-0.5 * D_I^-0.5``) belongs to the caller.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..checks import check_same_dtype, check_tensor
from ..offsets import host_offsets
from .masks import (
    check_key_mask,
    check_positions,
    key_segments,
    remember_visible,
    visible_keys,
    visible_mask,
    visible_range,
)

DEFAULT_QUERY_BLOCK = 256
# Keys scored at a time inside a query block: keeps the per-head [block, H_I, chunk] ReLU terms small
# while the [block, S] score rows are assembled.
DEFAULT_KEY_CHUNK = 4096


def _check_indexer_inputs(q_index: torch.Tensor, k_index: torch.Tensor, weights: torch.Tensor) -> None:
    check_tensor("q_index", q_index, ndim=4, floating=True)
    B, T, Hi, Di = q_index.shape
    check_tensor("k_index", k_index, shape=(B, None, Di), floating=True)
    check_tensor("weights", weights, shape=(B, T, Hi), floating=True)
    check_same_dtype(q_index=q_index, k_index=k_index, weights=weights)


def indexer_scores(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    query_offset: int = 0,
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense index scores (the reference for ``indexer_topk``, and the input of the indexer loss).

    q_index: ``[B, T, H_I, D_I]``; k_index: ``[B, S, D_I]``; weights: ``[B, T, H_I]``;
    cu_seqlens: ``[N+1]`` packed boundaries over the S keys (batch 1); query t sits at ``query_offset + t``;
    key_mask: ``[B, S]`` bool, False = a key never seen (padding).
    Returns ``[B, T, S]``, ``-inf`` at keys the query cannot see. Differentiable in all three inputs.
    """
    _check_indexer_inputs(q_index, k_index, weights)
    B, T = q_index.shape[:2]
    S = k_index.shape[1]
    check_positions(query_offset, B, T, S, cu_seqlens)
    check_key_mask(key_mask, B, S)
    scores = _WeightedReluScores.apply(q_index, k_index, weights)
    return scores.masked_fill(~visible_keys(T, S, query_offset, cu_seqlens, key_mask, q_index.device), -math.inf)


class _WeightedReluScores(torch.autograd.Function):
    """``sum_j w[:, :, j] * ReLU(q[:, :, j] @ k^T)`` one index head at a time, in both passes.

    The plain einsum form keeps a ``[B, T, H_I, S]`` tensor for backward (17 GiB per layer at T = S = 8192
    with 64 fp32 heads); here only q, k and w are saved and each head's ``[B, T, S]`` product is recomputed.
    """

    @staticmethod
    def forward(ctx, q, k, w):
        ctx.save_for_backward(q, k, w)
        kt = k.transpose(1, 2)
        out = q.new_zeros(q.shape[0], q.shape[1], k.shape[1])
        for j in range(q.shape[2]):
            out.addcmul_(torch.relu(torch.bmm(q[:, :, j], kt)), w[:, :, j, None])
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, w = ctx.saved_tensors
        kt = k.transpose(1, 2)
        dq, dk, dw = torch.empty_like(q), torch.zeros_like(k), torch.empty_like(w)
        for j in range(q.shape[2]):
            r = torch.bmm(q[:, :, j], kt).relu_()  # [B, T, S]
            dw[:, :, j] = (grad * r).sum(-1)
            d_r = (grad * w[:, :, j, None]).masked_fill_(r == 0, 0.0)  # ReLU's gradient: 0 where q.k <= 0
            dq[:, :, j] = torch.bmm(d_r, k)
            dk += torch.bmm(d_r.transpose(1, 2), q[:, :, j])
        return dq, dk, dw


@torch.no_grad()
def indexer_topk(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: Optional[torch.Tensor] = None,
    query_offset: int = 0,
    block_size: int = DEFAULT_QUERY_BLOCK,
    key_chunk: int = DEFAULT_KEY_CHUNK,
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The ``topk`` visible keys of highest index score per query, scored one block of queries at a time.

    Shapes as ``indexer_scores`` (masked-out keys of ``key_mask`` are never selected). Ties at the k-th
    score go to the latest keys. Returns ``[B, T, min(topk, S)]`` int64 key positions (order unspecified);
    slots beyond a query's visible keys hold ``-1``. Memory: ``block_size * S`` scores plus
    ``block_size * H_I * key_chunk`` per-head terms, never ``T x S``. Not differentiable (an index choice).
    Host reads: none, or cu_seqlens once (``ops.offsets.host_offsets``). The result carries its queries' visible
    key ranges (``masks.remember_visible``), so ``sparse_attention`` on it reads nothing either.
    """
    _check_indexer_inputs(q_index, k_index, weights)
    if not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk: expected a positive int, got {topk!r}")
    for name, value in (("block_size", block_size), ("key_chunk", key_chunk)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    B, T = q_index.shape[:2]
    S = k_index.shape[1]
    check_positions(query_offset, B, T, S, cu_seqlens)
    check_key_mask(key_mask, B, S)
    segments = key_segments(cu_seqlens, S, q_index.device)
    starts = host_offsets(cu_seqlens)  # the call's one host read, with packed sequences only
    k_out = min(topk, S)
    out = torch.full((B, T, k_out), -1, dtype=torch.int64, device=q_index.device)
    for t0 in range(0, T, block_size):
        t1 = min(T, t0 + block_size)
        lo, hi = visible_range(t0, t1, S, query_offset, starts)
        if hi <= lo:
            continue
        mask = visible_mask(t0, t1, lo, hi, query_offset, segments, q_index.device)
        take = min(k_out, hi - lo)
        for b in range(B):
            scores = _block_scores(q_index[b, t0:t1], k_index[b, lo:hi], weights[b, t0:t1], key_chunk)
            scores.masked_fill_(~(mask if key_mask is None else mask & key_mask[b, lo:hi]), -math.inf)
            idx = _topk_latest_on_ties(scores, take)
            out[b, t0:t1, :take] = torch.where(scores.gather(1, idx) == -math.inf, -1, idx + lo)
    # every selected key lies in its query's visible range: sparse_attention bounds its blocks by it, no read
    return remember_visible(out, query_offset, S, starts)


def _topk_latest_on_ties(scores: torch.Tensor, take: int) -> torch.Tensor:
    """Columns ``[Bq, take]`` of the ``take`` highest scores of each row of ``scores`` ``[Bq, n]``; among keys
    tied at the k-th score, the latest win.

    torch.topk breaks ties in no promised order, and ties are common here (ReLU makes many scores exactly 0).
    A fixed rule that depends only on the keys' order keeps the choice the same wherever a row's keys start,
    e.g. for a left-padded row and the same prompt alone.

    One top-k over the pairs (score, column) in lexicographic order, with no host read: a float32 score's bits
    as an order-preserving int32 in the high half of an int64, the column in the low half (fp16 / bf16 widen
    to float32 exactly). Other dtypes (float64) take a stable sort of the reversed row instead.
    """
    n = scores.shape[-1]
    if take >= n:  # every key is chosen: nothing to break
        return scores.topk(take, dim=-1, sorted=False).indices
    if scores.dtype in (torch.float32, torch.float16, torch.bfloat16):
        # + 0.0: -0.0 becomes +0.0 (equal scores, equal bits); a copy, so the steps below work in place
        x = scores.add(0.0) if scores.dtype == torch.float32 else scores.float().add_(0.0)
        bits = x.view(torch.int32)
        ordered = bits >> 31  # -1 for a negative float, else 0
        ordered &= 0x7FFFFFFF
        ordered ^= bits  # negative floats: every bit but the sign flipped, so their order reverses
        keys = ordered.to(torch.int64)
        keys <<= 32
        keys |= torch.arange(n, device=scores.device)
        return keys.topk(take, dim=-1, sorted=False).values & 0xFFFFFFFF
    # A stable sort keeps tied entries in order; on the reversed row the first of them is the latest key.
    first = scores.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :take]
    return (n - 1) - first


def _block_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, key_chunk: int) -> torch.Tensor:
    """``[Bq, n]`` index scores of queries q ``[Bq, H_I, D_I]`` (weights w ``[Bq, H_I]``) on keys k ``[n, D_I]``.

    One GEMM per index head and chunk of keys, summed into the scores with ``addcmul_`` in head order, as
    ``indexer_scores`` sums them (a batched ``[1, H_I] @ [H_I, c]`` product per query is a slow GEMV on a CPU).
    """
    Bq, Hi, _ = q.shape
    n = k.shape[0]
    scores = q.new_empty(Bq, n)
    kt = k.t()
    for c0 in range(0, n, key_chunk):
        c1 = min(n, c0 + key_chunk)
        out = scores[:, c0:c1]
        for j in range(Hi):
            r = torch.relu_(torch.matmul(q[:, j], kt[:, c0:c1]))
            if j == 0:
                out.copy_(r.mul_(w[:, j, None]))
            else:
                out.addcmul_(r, w[:, j, None])
    return scores
