"""Softmax attention over a chosen set of keys per query: DSA's sparse attention and its dense causal case.

Both run through one blocked kernel. For each block of queries it takes the span of key positions the block
uses (smallest to largest selected key, or the causally visible span) and computes the block's scores and
outputs as dense matrix products over that span. Sparse attention then gathers each query's k selected
scores, runs the softmax on those ``[H, Bq, k]`` values alone and scatters the probabilities back for the
product with V. On a CPU this beats gathering k keys and values per query (a memory-bound copy of
``T*k*H*D`` values) because every product is a GEMM and every elementwise pass but a zero fill is O(k).
Transient memory per block: ``H * block * span`` scores, ``span <= S`` (and ``<= block * k`` keys apart
at most when selections cluster).

The autograd Function saves only q, k, v, the output and the log-sum-exp, and recomputes each block's
probabilities in backward (as flash attention does), so neither pass ever holds ``T x S`` scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..checks import check_same_dtype, check_tensor
from .masks import check_positions, key_segments, visible_mask, visible_range

DEFAULT_BLOCK = 64


@dataclass
class BlockKeys:
    """The keys one block of queries uses: a span ``[lo, hi)`` of key positions, and who sees what in it.

    Exactly one of the two is set. allowed: ``[Bq, n]`` bool, each query's visible keys (dense attention).
    pos: ``[Bq, k]`` int64 column in the span of each query's selected keys, ``n`` (a spare column past the
    span) for an empty slot (sparse attention: softmax runs over the k selected scores only).
    """

    lo: int
    hi: int
    allowed: Optional[torch.Tensor] = None
    pos: Optional[torch.Tensor] = None


KeyPlan = Callable[[int, int, int], BlockKeys]  # (batch row b, t0, t1) -> the keys of queries t0..t1-1


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    check_tensor("q", q, ndim=4, floating=True)
    B, _, H, D = q.shape
    check_tensor("k", k, shape=(B, None, H, D), floating=True)
    check_tensor("v", v, shape=(B, k.shape[1], H, None), floating=True)
    check_same_dtype(q=q, k=k, v=v)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: expected a positive number, got {scale!r}")


def _check_block(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """``[S, H, D]`` -> contiguous ``[H, S, D]``, so that a block's span of keys is a view."""
    return x.transpose(0, 1).contiguous()


def _scatter_columns(values: torch.Tensor, pos: torch.Tensor, n: int) -> torch.Tensor:
    """``[H, Bq, n]`` zeros holding ``values`` ``[H, Bq, k]`` at columns ``pos`` (spare column n dropped)."""
    H, Bq, _ = values.shape
    full = values.new_zeros(H, Bq, n + 1)
    return full.scatter_(2, pos.expand(H, -1, -1), values)[..., :n]


def _selected(scores: torch.Tensor, keys: BlockKeys) -> torch.Tensor:
    """The block's scores ``[H, Bq, n]`` at each query's selected keys, ``[H, Bq, k]``, -inf at empty slots."""
    n = keys.hi - keys.lo
    pos = keys.pos.clamp_max(n - 1).expand(scores.shape[0], -1, -1)
    return scores.gather(2, pos)


def _finite_or(x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.full_like(x, fill))


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, block: int, plan: KeyPlan):
        B, T, H, _ = q.shape
        out = q.new_zeros(B, T, H, v.shape[-1])
        lse = q.new_full((B, T, H), -math.inf)
        for b in range(B):
            q_t, k_t, v_t = _head_major(q[b] * scale), _head_major(k[b]), _head_major(v[b])
            for t0 in range(0, T, block):
                t1 = min(T, t0 + block)
                keys = plan(b, t0, t1)
                n = keys.hi - keys.lo
                if n <= 0:
                    continue
                s = torch.matmul(q_t[:, t0:t1], k_t[:, keys.lo:keys.hi].transpose(1, 2))  # [H, Bq, n]
                if keys.pos is None:
                    s.masked_fill_(~keys.allowed, -math.inf)
                    m = _finite_or(s.amax(-1, keepdim=True), 0.0)  # 0 for a query that sees no key
                    p = s.sub_(m).exp_()
                else:
                    s_sel = _selected(s, keys)
                    m = _finite_or(s_sel.amax(-1, keepdim=True), 0.0)
                    p_sel = s_sel.sub_(m).exp_()
                    p = _scatter_columns(p_sel, keys.pos, n)
                denom = p.sum(-1, keepdim=True)
                o = torch.matmul(p, v_t[:, keys.lo:keys.hi]) / denom.clamp_min(torch.finfo(p.dtype).tiny)
                out[b, t0:t1] = o.transpose(0, 1)
                lse[b, t0:t1] = (m + denom.log()).squeeze(-1).transpose(0, 1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.block, ctx.plan = scale, block, plan
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, block, plan = ctx.scale, ctx.block, ctx.plan
        B, T, H, _ = q.shape
        delta = (grad_out * out).sum(-1)  # [B, T, H]: sum_s p_s dp_s, the softmax Jacobian's shift
        lse = _finite_or(lse, math.inf)  # a query that saw no key: its recomputed probabilities become 0
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b in range(B):
            q_t, k_t, v_t = _head_major(q[b] * scale), _head_major(k[b]), _head_major(v[b])
            do_t = _head_major(grad_out[b])
            dk_t, dv_t = torch.zeros_like(k_t), torch.zeros_like(v_t)
            for t0 in range(0, T, block):
                t1 = min(T, t0 + block)
                keys = plan(b, t0, t1)
                n = keys.hi - keys.lo
                if n <= 0:
                    continue
                span = slice(keys.lo, keys.hi)
                q_blk, do_blk = q_t[:, t0:t1], do_t[:, t0:t1]
                lse_blk = lse[b, t0:t1].transpose(0, 1).unsqueeze(-1)
                delta_blk = delta[b, t0:t1].transpose(0, 1).unsqueeze(-1)
                s = torch.matmul(q_blk, k_t[:, span].transpose(1, 2))
                dp = torch.matmul(do_blk, v_t[:, span].transpose(1, 2))
                if keys.pos is None:
                    s.masked_fill_(~keys.allowed, -math.inf)
                    p = s.sub_(lse_blk).exp_()
                    ds = dp.sub_(delta_blk).mul_(p)
                else:
                    p_sel = _selected(s, keys).sub_(lse_blk).exp_()
                    dp_sel = dp.gather(2, keys.pos.clamp_max(n - 1).expand(H, -1, -1))
                    ds = _scatter_columns(dp_sel.sub_(delta_blk).mul_(p_sel), keys.pos, n)
                    p = _scatter_columns(p_sel, keys.pos, n)
                dq[b, t0:t1] = torch.matmul(ds, k_t[:, span]).transpose(0, 1) * scale
                dk_t[:, span] += torch.matmul(ds.transpose(1, 2), q_blk)
                dv_t[:, span] += torch.matmul(p.transpose(1, 2), do_blk)
            dk[b] = dk_t.transpose(0, 1)
            dv[b] = dv_t.transpose(0, 1)
        return dq, dk, dv, None, None, None


def check_indices(indices: torch.Tensor, batch: int, num_queries: int, num_keys: int) -> None:
    check_tensor("indices", indices, shape=(batch, num_queries, None))
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices: expected an int32/int64 tensor, got {indices.dtype}")
    if indices.numel() and (int(indices.min()) < -1 or int(indices.max()) >= num_keys):
        raise ValueError(f"indices: expected key positions in [0, {num_keys}) or -1, got values in "
                         f"[{int(indices.min())}, {int(indices.max())}]")


def _selection_plan(indices: torch.Tensor) -> KeyPlan:
    """Per block: the span from the smallest to the largest selected key, and each selection's column in it."""
    indices = indices.long()

    def plan(b: int, t0: int, t1: int) -> BlockKeys:
        idx = indices[b, t0:t1]  # [Bq, k]
        valid = idx >= 0
        if not bool(valid.any()):
            return BlockKeys(0, 0, pos=idx)
        lo, hi = int(idx.masked_fill(~valid, idx.max()).min()), int(idx.max()) + 1
        pos = torch.where(valid, idx - lo, hi - lo)
        seen = torch.zeros(idx.shape[0], hi - lo + 1, dtype=torch.bool, device=idx.device).scatter_(1, pos, True)
        if int(seen[:, :-1].sum()) != int(valid.sum()):
            raise ValueError(f"indices: a query of rows {t0}..{t1 - 1} (batch {b}) selects a key twice")
        return BlockKeys(lo, hi, pos=pos)

    return plan


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float,
                     block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Each query attends (softmax) over its selected keys only.

    q: ``[B, T, H, Dqk]``; k: ``[B, S, H, Dqk]``; v: ``[B, S, H, Dv]``; indices: ``[B, T, k]`` int key
    positions, ``-1`` = empty slot (a repeated position counts once); scale: multiplies ``q . k``.
    Returns ``[B, T, H, Dv]``; a query with no selected key gets zeros. Differentiable in q, k, v with
    O(T*k) saved state (inputs, output, log-sum-exp) and blocks of ``block_size`` queries recomputed in
    backward. Causality is whatever the indices say (``indexer_topk`` only selects visible keys).
    """
    check_attention_inputs(q, k, v, scale)
    _check_block(block_size)
    check_indices(indices, q.shape[0], q.shape[1], k.shape[1])
    return _BlockedAttention.apply(q, k, v, float(scale), block_size, _selection_plan(indices))


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           cu_seqlens: Optional[torch.Tensor] = None, query_offset: int = 0,
                           block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Causal softmax attention (the indexer-off path), blocked like ``sparse_attention``.

    q: ``[B, T, H, Dqk]`` at positions ``query_offset + t``; k: ``[B, S, H, Dqk]``; v: ``[B, S, H, Dv]``;
    cu_seqlens: ``[N+1]`` packed-sequence boundaries over the S keys (batch 1). Returns ``[B, T, H, Dv]``.
    """
    check_attention_inputs(q, k, v, scale)
    _check_block(block_size)
    S = k.shape[1]
    check_positions(query_offset, q.shape[0], q.shape[1], S, cu_seqlens)
    segments = key_segments(cu_seqlens, S, q.device)

    def plan(b: int, t0: int, t1: int):
        lo, hi = visible_range(t0, t1, S, query_offset, cu_seqlens)
        return BlockKeys(lo, hi, allowed=visible_mask(t0, t1, lo, hi, query_offset, segments, q.device))

    return _BlockedAttention.apply(q, k, v, float(scale), block_size, plan)


def sparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Plain dense version of ``sparse_attention`` (``T x S`` scores masked to the selected keys), for tests."""
    check_attention_inputs(q, k, v, scale)
    B, T, _, _ = q.shape
    S = k.shape[1]
    check_indices(indices, B, T, S)
    idx = indices.long()
    allowed = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(2, torch.where(idx >= 0, idx, S), True)
    return _masked_dense_attention(q, k, v, scale, allowed[..., :S])


def dense_causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                     cu_seqlens: Optional[torch.Tensor] = None,
                                     query_offset: int = 0) -> torch.Tensor:
    """Plain dense version of ``dense_causal_attention`` (one ``T x S`` masked softmax), for tests."""
    check_attention_inputs(q, k, v, scale)
    B, T, _, _ = q.shape
    S = k.shape[1]
    check_positions(query_offset, B, T, S, cu_seqlens)
    allowed = visible_mask(0, T, 0, S, query_offset, key_segments(cu_seqlens, S, q.device), q.device)
    return _masked_dense_attention(q, k, v, scale, allowed.expand(B, T, S))


def _masked_dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys ``allowed`` ``[B, T, S]`` marks; zeros for a query with none."""
    allowed = allowed[:, :, None, :]  # [B, T, 1, S]
    scores = torch.einsum("bthd,bshd->bths", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    probs = torch.where(allowed.any(-1, keepdim=True), probs, torch.zeros_like(probs))
    return torch.einsum("bths,bshd->bthd", probs, v)
