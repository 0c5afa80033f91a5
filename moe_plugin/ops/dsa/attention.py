"""Softmax attention over a chosen set of keys per query: the kernel of DSA's sparse attention and its dense
causal case.

Both run through one blocked kernel. A block of queries works on the span of key positions it uses (smallest
to largest selected key, or the causally visible span), in chunks of keys, with dense matrix products.
Sparse attention gathers each query's k selected scores from a chunk's product, runs the softmax arithmetic
on those ``[H, Bq, k]`` entries only and scatters the probabilities back for the product with V. On a CPU
this beats gathering k keys and values per query (a memory-bound copy of ``T*k*H*D`` values): every product
is a GEMM and every elementwise pass but a zero fill is O(k). Transient memory per block is a few
``H * block * key_chunk`` matrices, whatever S is.

Both passes are plain functions (``blocked_forward``, ``blocked_backward``) over a per-block key plan. Dense
causal attention runs them in the autograd Function here; sparse attention is the custom op of ``sparse_op.py``
over the same two (on CUDA tensors that op runs the one-launch Triton kernels of ``sparse_triton.py`` instead;
this loop is the CPU path). Either saves only q, k, v, the output and the log-sum-exp (sparse attention also its
indices), and recomputes each block's probabilities in backward (as flash attention does), so neither pass
ever holds ``T x S`` scores.

Host reads (issue 24): the block loop's bounds are host ints. Dense causal attention derives its spans from
the shapes (no read), with packed sequences from cu_seqlens read once per tensor; sparse attention's are in
``sparse_op.py``. Value checks (index range, repeated keys) run only with ``MOE_PLUGIN_DEBUG_CHECKS=1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from ..checks import check_ids_in_debug, check_same_dtype, check_tensor
from ..meta_loops import steps_to_run
from ..offsets import host_offsets
from .masks import (
    check_key_mask,
    check_positions,
    key_segments,
    visible_keys,
    visible_mask,
    visible_range,
)

DEFAULT_BLOCK = 64
DEFAULT_KEY_CHUNK = 8192


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


# (batch row b, t0, t1) -> the keys of queries t0..t1-1. A plan may carry ``span(b, t0, t1) -> (lo, hi)``, the
# block's key span without its masks: on meta the loops then run only the blocks that set their peak (_blocks).
KeyPlan = Callable[[int, int, int], BlockKeys]


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """q: ``[B, T, H, Dqk]``; k: ``[B, S, H, Dqk]``; v: ``[B, S, H, Dv]``, all one floating dtype; scale > 0."""
    check_tensor("q", q, ndim=4, floating=True)
    B, _, H, D = q.shape
    check_tensor("k", k, shape=(B, None, H, D), floating=True)
    check_tensor("v", v, shape=(B, k.shape[1], H, None), floating=True)
    check_same_dtype(q=q, k=k, v=v)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: expected a positive number, got {scale!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """``[S, H, D]`` -> contiguous ``[H, S, D]``, so that a block's span of keys is a view."""
    return x.transpose(0, 1).contiguous()


class _Chunk:
    """Keys ``[c0, c1)`` of a block's span, and how the block's attention entries map onto their columns.

    Dense plans attend to every allowed column. Sparse plans keep one entry per selected key (``[H, Bq, k]``):
    ``select`` gathers those entries from a ``[H, Bq, c]`` matrix, ``place`` scatters them back into zeros.
    """

    def __init__(self, keys: BlockKeys, c0: int, c1: int):
        self.width = c1 - c0
        offset = c0 - keys.lo
        self.cols = None
        if keys.pos is None:
            self.valid = keys.allowed[:, offset : offset + self.width]
        else:
            rel = keys.pos - offset
            self.valid = (rel >= 0) & (rel < self.width)
            self.cols = torch.where(self.valid, rel, self.width)  # width: a spare column, dropped by place()

    def select(self, x: torch.Tensor) -> torch.Tensor:
        if self.cols is None:
            return x
        return x.gather(2, self.cols.clamp_max(self.width - 1).expand(x.shape[0], -1, -1))

    def place(self, entries: torch.Tensor) -> torch.Tensor:
        if self.cols is None:
            return entries
        H, Bq, _ = entries.shape
        full = entries.new_zeros(H, Bq, self.width + 1)
        return full.scatter_(2, self.cols.expand(H, -1, -1), entries)[..., : self.width]

    def scores(self, s: torch.Tensor) -> torch.Tensor:
        """The entries of the score chunk ``s`` (``[H, Bq, c]``), ``-inf`` where the query has no key."""
        return self.select(s).masked_fill_(~self.valid, -math.inf)


def _chunks(keys: BlockKeys, key_chunk: int):
    return [_Chunk(keys, c0, min(keys.hi, c0 + key_chunk)) for c0 in range(keys.lo, keys.hi, key_chunk)]


def _blocks(T: int, block: int, key_chunk: int, plan: KeyPlan, b: int, meta: bool):
    """The ``(t0, t1)`` query blocks of batch row ``b`` the loops run: every one; on meta, with a plan that knows
    its spans, only the widest-spanned block of each kind (its length; one chunk of keys or several), as
    ``ops.meta_loops`` explains: a block frees what it makes before the next starts, and what it makes (its
    visibility mask ``[Bq, span]``, its chunks' ``[H, Bq, <= key_chunk]`` products, with one chunk the kept
    scores ``[H, Bq, span]``) grows with its span within a kind."""
    bounds = [(t0, min(T, t0 + block)) for t0 in range(0, T, block)]
    span = getattr(plan, "span", None)
    if span is None:
        return bounds
    widths = {}
    for t0, t1 in bounds if meta else ():
        lo, hi = span(b, t0, t1)
        widths[t0] = hi - lo
    return steps_to_run(
        bounds, meta, kind=lambda t: (t[1] - t[0], widths[t[0]] <= key_chunk), size=lambda t: widths[t[0]]
    )


def _finite_or(x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.full_like(x, fill))


def blocked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block: int, key_chunk: int, plan: KeyPlan
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blocks of queries x chunks of keys: each query's log-sum-exp over the chunks first, then
    ``exp(s - lse) @ V`` summed chunk by chunk. Shapes as ``check_attention_inputs``; returns the output
    ``[B, T, H, Dv]`` and the log-sum-exp ``[B, T, H]`` (q's dtype, ``-inf`` for a query that sees no key)."""
    B, T, H, _ = q.shape
    out = q.new_zeros(B, T, H, v.shape[-1])
    lse = q.new_full((B, T, H), -math.inf)
    for b in range(B):
        q_t, k_t, v_t = _head_major(q[b] * scale), _head_major(k[b]), _head_major(v[b])
        for t0, t1 in _blocks(T, block, key_chunk, plan, b, q.is_meta):
            # one call a block: what it makes is freed before the next block starts
            o, lse_blk = _forward_block(q_t[:, t0:t1], k_t, v_t, key_chunk, plan(b, t0, t1))
            out[b, t0:t1] = o.transpose(0, 1)
            lse[b, t0:t1] = lse_blk.squeeze(-1).transpose(0, 1)
            del o, lse_blk
    return out, lse


def _forward_block(q_blk, k_t, v_t, key_chunk: int, keys: BlockKeys) -> Tuple[torch.Tensor, torch.Tensor]:
    """One block of ``blocked_forward``: queries ``[H, Bq, D]``, keys and values head-major ``[H, S, D]`` ->
    its output ``[H, Bq, Dv]`` and log-sum-exp ``[H, Bq, 1]``."""
    H, Bq, _ = q_blk.shape
    chunks = _chunks(keys, key_chunk)
    lse_blk = q_blk.new_full((H, Bq, 1), -math.inf)
    kept = None
    for c0, ch in zip(range(keys.lo, keys.hi, key_chunk), chunks):
        sc = ch.scores(torch.matmul(q_blk, k_t[:, c0 : c0 + ch.width].transpose(1, 2)))
        lse_blk = torch.logaddexp(lse_blk, torch.logsumexp(sc, -1, keepdim=True))
        kept = sc if len(chunks) == 1 else None  # one chunk: no need to recompute it
        del sc
    shift = _finite_or(lse_blk, math.inf)  # a query that sees no key: probabilities 0
    o = q_blk.new_zeros(H, Bq, v_t.shape[-1])
    for c0, ch in zip(range(keys.lo, keys.hi, key_chunk), chunks):
        sc = kept if kept is not None else ch.scores(torch.matmul(q_blk, k_t[:, c0 : c0 + ch.width].transpose(1, 2)))
        o.baddbmm_(ch.place(sc.sub_(shift).exp_()), v_t[:, c0 : c0 + ch.width])
    return o, lse_blk


def blocked_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    block: int,
    key_chunk: int,
    plan: KeyPlan,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``blocked_forward`` in q, k, v (their shapes), from grad_out ``[B, T, H, Dv]`` and the
    forward's out and lse: each block's probabilities are recomputed, as flash attention does."""
    B, T, H, _ = q.shape
    if B == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (grad_out * out).sum(-1)  # [B, T, H]: sum_s p_s dp_s, the softmax Jacobian's shift
    lse = _finite_or(lse, math.inf)
    for b in range(B):
        q_t, k_t, v_t = _head_major(q[b] * scale), _head_major(k[b]), _head_major(v[b])
        do_t = _head_major(grad_out[b])
        dq_t, dk_t, dv_t = torch.zeros_like(q_t), torch.zeros_like(k_t), torch.zeros_like(v_t)
        for t0, t1 in _blocks(T, block, key_chunk, plan, b, q.is_meta):
            _backward_block(
                (q_t, k_t, v_t, do_t),
                (dq_t, dk_t, dv_t),
                lse[b, t0:t1].transpose(0, 1).unsqueeze(-1),
                delta[b, t0:t1].transpose(0, 1).unsqueeze(-1),
                t0,
                t1,
                key_chunk,
                plan(b, t0, t1),
            )
        del q_t, k_t, v_t, do_t
        if b == 0:  # made once the first row's loop is done: not held through it
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dq[b].copy_(dq_t.transpose(0, 1)).mul_(scale)
        dk[b].copy_(dk_t.transpose(0, 1))
        dv[b].copy_(dv_t.transpose(0, 1))
        del dq_t, dk_t, dv_t
    return dq, dk, dv


def _backward_block(inputs, grads, shift, delta_blk, t0: int, t1: int, key_chunk: int, keys: BlockKeys) -> None:
    """One block of ``blocked_backward``, added into the head-major gradients ``grads`` (dq, dk, dv ``[H, S, D]``)
    from the head-major ``inputs`` (q, k, v, grad_out), the block's log-sum-exp and softmax shift ``[H, Bq, 1]``."""
    q_t, k_t, v_t, do_t = inputs
    dq_t, dk_t, dv_t = grads
    q_blk, do_blk = q_t[:, t0:t1], do_t[:, t0:t1]
    for c0, ch in zip(range(keys.lo, keys.hi, key_chunk), _chunks(keys, key_chunk)):
        span = slice(c0, c0 + ch.width)
        p = ch.scores(torch.matmul(q_blk, k_t[:, span].transpose(1, 2))).sub_(shift).exp_()
        dp = ch.select(torch.matmul(do_blk, v_t[:, span].transpose(1, 2)))
        ds = ch.place(dp.sub_(delta_blk).mul_(p))
        dq_t[:, t0:t1].baddbmm_(ds, k_t[:, span])
        dk_t[:, span].baddbmm_(ds.transpose(1, 2), q_blk)
        dv_t[:, span].baddbmm_(ch.place(p).transpose(1, 2), do_blk)


class _BlockedAttention(torch.autograd.Function):
    """Dense causal attention's autograd: saves q, k, v, the output and the log-sum-exp (sparse attention is
    the custom op of ``sparse_op.py`` over the same two functions)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, block: int, key_chunk: int, plan: KeyPlan):
        out, lse = blocked_forward(q, k, v, scale, block, key_chunk, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.block, ctx.key_chunk, ctx.plan = scale, block, key_chunk, plan
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = blocked_backward(grad_out, q, k, v, out, lse, ctx.scale, ctx.block, ctx.key_chunk, ctx.plan)
        return (*grads, None, None, None, None)


def check_indices(indices: torch.Tensor, batch: int, num_queries: int, num_keys: int) -> None:
    """indices: ``[batch, num_queries, k]`` int32/int64 key positions in ``[0, num_keys)``, ``-1`` = empty slot.

    The shape and dtype always; the range only with ``MOE_PLUGIN_DEBUG_CHECKS=1`` (a host read). Repeats are
    not checked here (that would cost a sort); sparse_attention's plan rejects them per block in debug mode.
    """
    check_tensor("indices", indices, shape=(batch, num_queries, None))
    check_ids_in_debug("indices", indices, -1, num_keys, "key positions (-1 = empty slot)")


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cu_seqlens: Optional[torch.Tensor] = None,
    query_offset: int = 0,
    block_size: int = DEFAULT_BLOCK,
    key_chunk: int = DEFAULT_KEY_CHUNK,
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal softmax attention (the indexer-off path), blocked like ``sparse_attention``.

    q: ``[B, T, H, Dqk]`` at positions ``query_offset + t``; k: ``[B, S, H, Dqk]``; v: ``[B, S, H, Dv]``;
    cu_seqlens: ``[N+1]`` packed-sequence boundaries over the S keys (batch 1); key_mask: ``[B, S]`` bool,
    False = a key no query sees (padding). Returns ``[B, T, H, Dv]``; a query that sees no key gets zeros.
    """
    check_attention_inputs(q, k, v, scale)
    _check_positive("block_size", block_size)
    _check_positive("key_chunk", key_chunk)
    S = k.shape[1]
    check_positions(query_offset, q.shape[0], q.shape[1], S, cu_seqlens)
    check_key_mask(key_mask, q.shape[0], S)
    segments = key_segments(cu_seqlens, S, q.device)
    starts = host_offsets(cu_seqlens)  # the call's one host read, with packed sequences only

    def plan(b: int, t0: int, t1: int):
        lo, hi = visible_range(t0, t1, S, query_offset, starts)
        allowed = visible_mask(t0, t1, lo, hi, query_offset, segments, q.device)
        if key_mask is not None:
            allowed &= key_mask[b, lo:hi].to(q.device)
        return BlockKeys(lo, hi, allowed=allowed)

    plan.span = lambda b, t0, t1: visible_range(t0, t1, S, query_offset, starts)
    return _BlockedAttention.apply(q, k, v, float(scale), block_size, key_chunk, plan)


def sparse_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain dense version of ``sparse_attention`` (``T x S`` scores masked to the selected keys), for tests."""
    check_attention_inputs(q, k, v, scale)
    B, T, _, _ = q.shape
    S = k.shape[1]
    check_indices(indices, B, T, S)
    idx = indices.long()
    allowed = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(2, torch.where(idx >= 0, idx, S), True)
    return _masked_dense_attention(q, k, v, scale, allowed[..., :S])


def dense_causal_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    cu_seqlens: Optional[torch.Tensor] = None,
    query_offset: int = 0,
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plain dense version of ``dense_causal_attention`` (one ``T x S`` masked softmax), for tests."""
    check_attention_inputs(q, k, v, scale)
    B, T, _, _ = q.shape
    S = k.shape[1]
    check_positions(query_offset, B, T, S, cu_seqlens)
    check_key_mask(key_mask, B, S)
    allowed = visible_keys(T, S, query_offset, cu_seqlens, key_mask, q.device).expand(B, T, S)
    return _masked_dense_attention(q, k, v, scale, allowed)


def _masked_dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor
) -> torch.Tensor:
    """Softmax over the keys ``allowed`` ``[B, T, S]`` marks; zeros for a query with none."""
    allowed = allowed[:, :, None, :]  # [B, T, 1, S]
    scores = torch.einsum("bthd,bshd->bths", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    probs = torch.where(allowed.any(-1, keepdim=True), probs, torch.zeros_like(probs))
    return torch.einsum("bths,bshd->bthd", probs, v)
