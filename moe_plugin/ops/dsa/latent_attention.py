"""Softmax attention whose keys and values are expanded from a per-token latent one chunk of keys at a time.

Gated MLA's keys and values are a function of a small per-token latent (K3: ``c_kv`` and the shared rope key,
576 values a token, against ``H x (d_qk + d_v)`` = 30,720 expanded). Under context parallelism the latent of the
whole row is gathered (docs/context-parallel.md); expanding all of it would hold ``S x H x (d_qk + d_v)`` values
on the row's last rank. ``latent_attention`` never does: the loop runs over chunks of keys outside and blocks of
queries inside, so each chunk is expanded once (``expand``, the caller's ``latent -> (k, v)``, e.g. a norm and
``kv_b_proj``) and every query block that sees it takes its part with an online softmax (flash attention's
running maximum and sum per query, in fp32). The backward recomputes each chunk's expansion with autograd on,
runs the attention backward of every query block on it, and hands the chunk's key and value gradients to the
expansion's own backward (``torch.autograd.backward``): the latent chunk's gradient lands in the latent's, the
expansion's parameters accumulate theirs chunk by chunk, as DeepSpeed's tiled MLP does (``grads_ready`` tells
the caller which chunk is the last, for ZeRO-3's gradient hooks: ``compat.deepspeed.tiled_gradients``).

What a call holds: the latent ``[B, S, C]`` and the queries (saved), the output and log-sum-exp, fp32
accumulators of the queries' size, and one chunk's keys and values plus one block's ``[H, Bq, chunk]`` scores,
whatever S is. Which keys a query sees comes from a chunk plan (``causal_plan``, ``selection_plan``): for query
block ``t0 .. t1`` and a key range ``[lo, hi)`` inside its span, a ``BlockKeys`` over that range, as the blocked
kernel of ``attention.py`` takes (dense masks or sparse selections), whose ``_Chunk`` and ``_backward_block``
this reuses. On ``meta`` (the planner) only the peak-setting chunks and blocks run (``ops.meta_loops``).

``latent_attention_reference`` is the plain form: expand the whole latent, one masked softmax.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..checks import check_tensor
from ..meta_loops import steps_to_run
from ..offsets import host_offsets
from .attention import BlockKeys, _backward_block, _Chunk, _check_positive, _head_major, _masked_dense_attention
from .masks import key_segments, visible_mask, visible_range
from .sparse_op import _spans

DEFAULT_BLOCK = 64
# Keys expanded at a time: K3's 96 heads x (192 + 128) values a key, 1.26 GB of bf16 keys and values a chunk.
DEFAULT_KEY_CHUNK = 2048

# latent [B, n, C] -> keys [B, n, H, Dqk], values [B, n, H, Dv]
Expand = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
# (batch row b, t0, t1, lo, hi) -> the keys of queries t0..t1-1 inside [lo, hi); carries ``span(b, t0, t1)``, the
# block's whole key span, and ``blocks(T, block)``, the query blocks (none crossing a run of contiguous positions)
ChunkPlan = Callable[[int, int, int, int, int], BlockKeys]
# (first query, end query, position of the first): queries t0 .. t1-1 sit at positions pos .. pos + t1 - t0 - 1
QueryRuns = Sequence[Tuple[int, int, int]]


def _uniform_blocks(T: int, block: int) -> List[Tuple[int, int]]:
    return [(t0, min(T, t0 + block)) for t0 in range(0, T, block)]


def _runs_span(runs, num_keys: int, starts, t0: int, t1: int) -> Tuple[int, int]:
    """The smallest key span holding every key visible to queries ``t0 .. t1-1`` of ``runs`` (``QueryRuns``; the
    keys' document starts ``starts`` or None): the union of each run's part's ``visible_range``. Host ints."""
    lo, hi = num_keys, 0
    for r0, r1, pos in runs:
        a, b = max(t0, r0), min(t1, r1)
        if a < b:
            lo_r, hi_r = visible_range(a, b, num_keys, pos - r0, starts)
            if lo_r < hi_r:
                lo, hi = min(lo, lo_r), max(hi, hi_r)
    return (lo, hi) if lo < hi else (0, 0)


def causal_plan(
    num_keys: int,
    runs: QueryRuns,
    cu_seqlens: Optional[torch.Tensor] = None,
    key_mask: Optional[torch.Tensor] = None,
    device=None,
) -> ChunkPlan:
    """Causal attention within documents: query ``t`` of a run ``(t0, t1, pos)`` sits at ``pos + t - t0`` and sees
    keys ``<=`` its position of its own document (``cu_seqlens`` ``[N+1]`` over the keys, batch 1) that
    ``key_mask`` ``[B, S]`` allows. Query blocks never cross a run."""
    segments = key_segments(cu_seqlens, num_keys, device)
    starts = host_offsets(cu_seqlens)  # one host read, with packed sequences only
    runs = [tuple(int(x) for x in r) for r in runs]

    def offset(t0: int) -> int:
        for r0, r1, pos in runs:
            if r0 <= t0 < r1:
                return pos - r0
        raise ValueError(f"query {t0} lies in no run of {runs}")

    def plan(b: int, t0: int, t1: int, lo: int, hi: int) -> BlockKeys:
        allowed = visible_mask(t0, t1, lo, hi, offset(t0), segments, device)
        if key_mask is not None:
            allowed &= key_mask[b, lo:hi].to(allowed.device)
        return BlockKeys(lo, hi, allowed=allowed)

    plan.span = lambda b, t0, t1: _runs_span(runs, num_keys, starts, t0, t1)
    plan.blocks = lambda T, block: [blk for r0, r1, _ in runs for blk in _shifted(_uniform_blocks(r1 - r0, block), r0)]
    return plan


def _shifted(blocks, by: int):
    return [(t0 + by, t1 + by) for t0, t1 in blocks]


def selection_plan(
    indices: torch.Tensor,
    num_keys: int,
    block: int,
    runs: Optional[QueryRuns] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> ChunkPlan:
    """Sparse attention: each query sees the keys ``indices`` ``[B, T, k]`` selects (``-1`` empty). A block's span:
    with ``runs`` (the queries' positions, ``causal_plan``; ``cu_seqlens`` the keys' documents) the keys visible to
    its queries, which hold every key ``indexer_topk`` selects (host ints, no read); else from its smallest to its
    largest selected key (from ``indexer_topk``'s visible ranges without a read, else found once:
    ``sparse_op._spans``)."""
    if runs is not None:
        starts, T = host_offsets(cu_seqlens), indices.shape[1]
        row = [_runs_span(runs, num_keys, starts, t0, t1) for t0, t1 in _uniform_blocks(T, block)]
        spans = [row] * indices.shape[0]
    else:
        spans = _spans(indices, block, num_keys)
    idx_all = indices.long()

    def plan(b: int, t0: int, t1: int, lo: int, hi: int) -> BlockKeys:
        idx = idx_all[b, t0:t1]
        inside = (idx >= lo) & (idx < hi)
        return BlockKeys(lo, hi, pos=torch.where(inside, idx - lo, hi - lo))

    plan.span = lambda b, t0, t1: spans[b][t0 // block]
    plan.blocks = _uniform_blocks
    return plan


def _within(keys: BlockKeys, c0: int) -> BlockKeys:
    """``keys`` with its span counted from ``c0`` (a chunk's first key), for tensors of that chunk alone."""
    return BlockKeys(keys.lo - c0, keys.hi - c0, allowed=keys.allowed, pos=keys.pos)


def _steps(b: int, T: int, S: int, block: int, key_chunk: int, plan: ChunkPlan, meta: bool, backward: bool = False):
    """``[(c0, c1, [(t0, t1, lo, hi), ...]), ...]``: each chunk of keys and the query blocks whose span meets it,
    with the part ``[lo, hi)`` they meet. On meta only the widest of each kind run (``ops.meta_loops``): a chunk
    holds its keys and values (its width) while its blocks run one at a time, each freeing what it makes (its
    mask and ``[H, Bq, hi - lo]`` scores) before the next."""
    blocks = [(t0, t1, *plan.span(b, t0, t1)) for t0, t1 in plan.blocks(T, block)]
    chunks = []
    for c0 in range(0, S, key_chunk):
        c1 = min(S, c0 + key_chunk)
        meets = [(t0, t1, max(lo, c0), min(hi, c1)) for t0, t1, lo, hi in blocks if max(lo, c0) < min(hi, c1)]
        if meets:
            meets = steps_to_run(meets, meta, kind=lambda s: s[1] - s[0], size=lambda s: s[3] - s[2])
        if meets or not meta:  # every chunk is expanded off meta, met or not: the same calls whatever the queries
            chunks.append((c0, c1, meets))
    if not meta:
        return chunks
    # a chunk's peak: its keys and values (its width) and its widest block of the largest peak, which grows with
    # a block's query count and its width in the chunk: for each query count, the chunk where it is widest
    chosen = set()
    for size in {t1 - t0 for c in chunks for t0, t1, _, _ in c[2]}:
        widest = lambda c, n=size: max((hi - lo for t0, t1, lo, hi in c[2] if t1 - t0 == n), default=-1)  # noqa: E731
        chosen.update(c[0] for c in steps_to_run(chunks, meta, kind=lambda c: c[1] - c[0], size=widest))
    run = [c for c in chunks if c[0] in chosen]
    if backward and len(chunks) > 1:
        # a chunk's parameter gradients after the first add to the sum so far (a new tensor each time), so on
        # meta the first chunk runs once before the ones that set the peak, as off meta
        run = run[:1] + run
    return run


def _finite_or(x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.full_like(x, fill))


def _expanded(expand: Expand, latent: torch.Tensor, H: int) -> Tuple[torch.Tensor, torch.Tensor]:
    k, v = expand(latent)
    check_tensor("expand(latent)[0]", k, shape=(latent.shape[0], latent.shape[1], H, None))
    check_tensor("expand(latent)[1]", v, shape=(latent.shape[0], latent.shape[1], H, None))
    return k, v


def latent_forward(q, latent, expand: Expand, scale: float, plan: ChunkPlan, block: int, key_chunk: int):
    """The forward: output ``[B, T, H, Dv]`` (q's dtype) and log-sum-exp ``[B, T, H]`` (fp32 or q's wider dtype,
    ``-inf`` for a query that sees no key). Shapes as ``latent_attention``."""
    B, T, H, _ = q.shape
    S = latent.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)  # the softmax statistics: fp32 or wider
    out, lse = None, q.new_full((B, T, H), -math.inf, dtype=wide)
    for b in range(B):
        q_t = _head_major(q[b] * scale)
        m = q_t.new_full((H, T, 1), -math.inf, dtype=wide)  # running maximum
        total = torch.zeros_like(m)  # running sum of exp(s - m)
        acc = None  # running sum of exp(s - m) v, [H, T, Dv] fp32
        for c0, c1, meets in _steps(b, T, S, block, key_chunk, plan, q.is_meta):
            k, v = _expanded(expand, latent[b : b + 1, c0:c1], H)
            k_t, v_t = _head_major(k[0]), _head_major(v[0])
            del k, v
            if acc is None:
                acc = q_t.new_zeros(H, T, v_t.shape[-1], dtype=wide)
            for t0, t1, lo, hi in meets:
                _online_block(q_t[:, t0:t1], k_t, v_t, _within(plan(b, t0, t1, lo, hi), c0), m, total, acc, t0, t1)
            del k_t, v_t
        if out is None:
            Dv = acc.shape[-1] if acc is not None else _expanded(expand, latent[:1, :0], H)[1].shape[-1]
            out = q.new_zeros(B, T, H, Dv)
        if acc is not None:
            seen = total > 0
            out[b] = torch.where(seen, acc / torch.where(seen, total, 1.0), 0.0).transpose(0, 1).to(q.dtype)
            lse[b] = torch.where(seen, m + torch.log(total), -math.inf).squeeze(-1).transpose(0, 1)
    return out, lse


def _online_block(q_blk, k_t, v_t, keys: BlockKeys, m, total, acc, t0: int, t1: int) -> None:
    """One query block ``[H, Bq, D]`` on one chunk's keys and values (head-major ``[H, n, D]``): the running
    maximum, sum and output of its queries (rows ``t0 .. t1`` of ``m``, ``total``, ``acc``) updated in place."""
    ch = _Chunk(keys, keys.lo, keys.hi)
    sc = ch.scores(torch.matmul(q_blk, k_t[:, keys.lo : keys.hi].transpose(1, 2))).to(m.dtype)
    m_old = m[:, t0:t1]
    m_new = torch.maximum(m_old, sc.amax(-1, keepdim=True))
    shift = _finite_or(m_new, 0.0)  # no key seen yet: every term is exp(-inf) = 0
    rescale = torch.exp(m_old - shift)  # exp(-inf) = 0 for a query with nothing yet
    p = sc.sub_(shift).exp_()
    total[:, t0:t1] = total[:, t0:t1] * rescale + p.sum(-1, keepdim=True)
    pv = torch.matmul(ch.place(p).to(v_t.dtype), v_t[:, keys.lo : keys.hi]).to(m.dtype)
    acc[:, t0:t1] = acc[:, t0:t1] * rescale + pv
    m[:, t0:t1] = m_new


def latent_backward(grad_out, q, latent, expand: Expand, out, lse, scale, plan, block, key_chunk, grads_ready):
    """The gradients in q and the latent (their shapes; None for one that needs none). Each chunk's keys and
    values are expanded again with autograd on; its query blocks' attention backward (``_backward_block``, the
    probabilities recomputed from the log-sum-exp) gives their gradients, which ``torch.autograd.backward`` takes
    through the expansion: into the latent chunk's and into the expansion's parameters'."""
    B, T, H, _ = q.shape
    S = latent.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)
    delta = (grad_out.to(wide) * out.to(wide)).sum(-1).to(q.dtype)  # [B, T, H]
    shift_all = _finite_or(lse, math.inf).to(q.dtype)
    dq = torch.zeros_like(q) if q.requires_grad else None
    dlatent = torch.zeros_like(latent) if latent.requires_grad else None
    steps = [_steps(b, T, S, block, key_chunk, plan, q.is_meta, backward=True) for b in range(B)]
    last = max((b for b in range(B) if steps[b]), default=-1)
    for b in range(B):
        q_t, do_t = _head_major(q[b] * scale), _head_major(grad_out[b])
        dq_t = torch.zeros_like(q_t)
        for i, (c0, c1, meets) in enumerate(steps[b]):
            piece = latent[b : b + 1, c0:c1].detach().requires_grad_(latent.requires_grad)
            with torch.enable_grad():
                k, v = _expanded(expand, piece, H)
            k_t, v_t = _head_major(k[0].detach()), _head_major(v[0].detach())
            dk_t, dv_t = torch.zeros_like(k_t), torch.zeros_like(v_t)
            for t0, t1, lo, hi in meets:
                _backward_block(
                    (q_t, k_t, v_t, do_t),
                    (dq_t, dk_t, dv_t),
                    shift_all[b, t0:t1].transpose(0, 1).unsqueeze(-1),
                    delta[b, t0:t1].transpose(0, 1).unsqueeze(-1),
                    t0,
                    t1,
                    hi - lo,
                    _within(plan(b, t0, t1, lo, hi), c0),
                )
            del k_t, v_t
            pairs = [(t, g.transpose(0, 1).unsqueeze(0)) for t, g in ((k, dk_t), (v, dv_t)) if t.requires_grad]
            if pairs:
                if grads_ready is not None:
                    grads_ready(b == last and i == len(steps[b]) - 1)
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            if dlatent is not None and piece.grad is not None:
                dlatent[b : b + 1, c0:c1] += piece.grad
            del k, v, dk_t, dv_t, pairs, piece
        del q_t, do_t
        if dq is not None:
            dq[b].copy_(dq_t.transpose(0, 1)).mul_(scale)
        del dq_t
    return dq, dlatent


class _LatentAttention(torch.autograd.Function):
    """Saves q, the latent, the output and the log-sum-exp; the expansion's parameters get their gradients from
    the backward's own ``torch.autograd.backward`` per chunk (module docstring)."""

    @staticmethod
    def forward(ctx, q, latent, expand, scale, plan, block, key_chunk, grads_ready):
        out, lse = latent_forward(q, latent, expand, scale, plan, block, key_chunk)
        ctx.save_for_backward(q, latent, out, lse)
        ctx.args = (expand, scale, plan, block, key_chunk, grads_ready)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, latent, out, lse = ctx.saved_tensors
        expand, scale, plan, block, key_chunk, grads_ready = ctx.args
        q = q.detach().requires_grad_(ctx.needs_input_grad[0])
        latent = latent.detach().requires_grad_(ctx.needs_input_grad[1])
        dq, dlatent = latent_backward(grad_out, q, latent, expand, out, lse, scale, plan, block, key_chunk, grads_ready)
        return dq, dlatent, None, None, None, None, None, None


def latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    expand: Expand,
    scale: float,
    plan: ChunkPlan,
    block_size: int = DEFAULT_BLOCK,
    key_chunk: int = DEFAULT_KEY_CHUNK,
    grads_ready: Optional[Callable[[bool], None]] = None,
) -> torch.Tensor:
    """Softmax attention of q ``[B, T, H, Dqk]`` over the keys and values ``expand`` makes from ``latent``
    ``[B, S, C]`` (``expand(latent[:, c0:c1])`` -> ``[B, n, H, Dqk]``, ``[B, n, H, Dv]``), ``key_chunk`` keys
    at a time; which keys each query sees: ``plan`` (``causal_plan``, ``selection_plan``). Returns ``[B, T, H,
    Dv]``; a query that sees no key gets zeros. Differentiable in q, latent and whatever ``expand`` uses (its
    parameters accumulate their gradients chunk by chunk in the backward; ``grads_ready(last)`` is called before
    each chunk's, True for the last)."""
    check_tensor("q", q, ndim=4, floating=True)
    check_tensor("latent", latent, shape=(q.shape[0], None, None), floating=True)
    _check_positive("block_size", block_size)
    _check_positive("key_chunk", key_chunk)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: expected a positive number, got {scale!r}")
    return _LatentAttention.apply(q, latent, expand, float(scale), plan, block_size, key_chunk, grads_ready)


def latent_attention_reference(
    q: torch.Tensor, latent: torch.Tensor, expand: Expand, scale: float, allowed: torch.Tensor
) -> torch.Tensor:
    """The plain form of ``latent_attention``: the whole latent expanded at once, one softmax over the keys
    ``allowed`` ``[B, T, S]`` marks (zeros for a query with none). For tests."""
    k, v = expand(latent)
    return _masked_dense_attention(q, k, v, scale, allowed)


@torch.no_grad()
def latent_attention_target(
    q: torch.Tensor,
    latent: torch.Tensor,
    expand: Expand,
    scale: float,
    runs: QueryRuns,
    cu_seqlens: Optional[torch.Tensor] = None,
    key_chunk: int = DEFAULT_KEY_CHUNK,
) -> torch.Tensor:
    """``ops.dsa.attention_target`` (each head's causal softmax, summed over heads, L1-normalised per query: the
    indexer loss's target) over keys expanded ``key_chunk`` at a time: one pass for each head's log-sum-exp,
    one for the probabilities. q ``[B, T, H, D]`` in ``runs`` (``causal_plan``); returns ``[B, T, S]``."""
    B, T, H, _ = q.shape
    S = latent.shape[1]
    plan = causal_plan(S, runs, cu_seqlens, device=q.device)
    visible = torch.zeros(T, S, dtype=torch.bool, device=q.device)
    for r0, r1, _ in runs:
        lo, hi = plan.span(0, r0, r1)
        visible[r0:r1, lo:hi] = plan(0, r0, r1, lo, hi).allowed
    chunks = [(c0, min(S, c0 + key_chunk)) for c0 in range(0, S, key_chunk)]
    q = q * scale
    lse = q.new_full((B, T, H), -math.inf)
    for c0, c1 in chunks:
        k = expand(latent[:, c0:c1])[0]  # [B, n, H, D]
        for h in range(H):
            s = torch.matmul(q[:, :, h], k[:, :, h].transpose(1, 2)).masked_fill_(~visible[:, c0:c1], -math.inf)
            lse[..., h] = torch.logaddexp(lse[..., h], torch.logsumexp(s, -1))
    shift = _finite_or(lse, math.inf)
    target = q.new_zeros(B, T, S)
    for c0, c1 in chunks:
        k = expand(latent[:, c0:c1])[0]
        for h in range(H):
            s = torch.matmul(q[:, :, h], k[:, :, h].transpose(1, 2)).masked_fill_(~visible[:, c0:c1], -math.inf)
            target[:, :, c0:c1] += s.sub_(shift[..., h, None]).exp_()
    return target / target.sum(-1, keepdim=True).clamp_min(torch.finfo(target.dtype).tiny)
