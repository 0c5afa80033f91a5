"""KDA over one rank's contiguous slice of a row under context parallelism (docs/context-parallel.md).

The state leaving a run of chunks is affine in the state entering it (``chunk.py``): the slice's last document,
run from a zero state, leaves ``S_out = A S_in + b``, with ``A`` ``[H, K, K]`` the product of its chunks'
transitions and ``b`` ``[H, K, V]`` its final state from zero (``A = 0`` where a document begins in the slice:
its state does not depend on what enters). The pairs compose, ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)``,
so the state entering rank r is the composition of ranks ``0 .. r-1`` applied to a zero state: a prefix scan
over the context group (Hillis-Steele: in round i each rank receives the prefix of rank ``r - 2^i`` through
``ContextSlice.shifted`` and composes it under its own), then one more shift hands each rank its
predecessor's state. Each round moves one pair (the compute dtype, fp32 or wider; ``K (K + V)`` values per
head, whatever the slice's length) and a rank holds two at a time, so the memory is independent of the group's
size and the bytes sent grow with its logarithm. Documents that begin inside a slice start from zero where they
begin. Backward is autograd's mirror of the same steps, each shift's gradient sent back the way it came; every
rank's rounds form one chain, so every rank runs the shifts' backwards in the same order.

The slice's chunks run through ``chunk.run_chunks`` (windows of chunks, each window's terms recomputed in
backward): once for the last document from a zero state, carrying ``[b | A]`` from ``[0 | I]`` when ``A`` is
wanted (its output kept unless the slice is one document that continues from the predecessors), and once more
for the documents before it, the first from the scan's entering state. Only a slice that is one continuing
document runs its chunks twice forward (the first pass without the queries' scores).

The slice's documents come from ``context.offsets`` (host ints): nothing is read from the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_plugin.ops.context import ContextSlice, check_context_rows, join_backward
from moe_plugin.ops.kda.chunk import ChunkLayout, ChunkRun, run_chunks
from moe_plugin.ops.kda.gate import l2norm
from moe_plugin.ops.kda.inputs import check_kda_inputs, compute_dtype, max_decay
from moe_plugin.ops.offsets import offsets_tensor


def chunk_kda_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    context: ContextSlice,
    scale: Optional[float] = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
    gate_lower_bound: Optional[float] = None,
) -> torch.Tensor:
    """``chunk_kda`` of the whole row, this rank's part: equal to ``context.take(chunk_kda(row)[0])``.

    Args:
        q, k: ``[B, L, H, K]``; v: ``[B, L, H, V]``; g: ``[B, L, H, K]``; beta: ``[B, L, H]``: this rank's
            slice (``L = context.length``; B must be 1 when the row packs several documents).
        context: the slice, its row's documents and the context group's differentiable gather.
        scale, chunk_size, use_qk_l2norm_in_kernel, gate_lower_bound: as ``chunk_kda`` (the torch chunk path
            always runs).
    Returns:
        o ``[B, L, H, V]`` in v's dtype.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    dims = check_kda_inputs(q, k, v, g, beta, scale, None, None)
    decay_bound = max_decay(g, gate_lower_bound)
    check_context_rows(context, "q", q.shape[0], q.shape[1])
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    dtype = compute_dtype(q, g)
    local = context.local_offsets()
    cu_seqlens = offsets_tensor(local, q.device) if len(local) > 2 else None
    layout = ChunkLayout(dims.seq_len, chunk_size, cu_seqlens, q.device)
    qc, kc, vc, gc, bc = (layout.to_chunks(x.to(dtype)) for x in (q, k, v, g, beta))
    qc = qc * dims.scale
    BH, K, V = qc.shape[1], dims.key_dim, dims.value_dim

    segments = layout.segments
    last_first, num_chunks = segments[-1]
    # A is read only by successors whose document passes through this whole slice
    through = len(segments) == 1 and context.continues and _next_continues(context)
    # The last document from a zero state: the pair's b (and A, carried beside it as [S | Phi] from [0 | I]),
    # and its output too unless it is the first document and continues from the predecessors.
    own_output = len(segments) > 1 or not context.continues
    pair_start = None
    if through:
        eye = torch.eye(K, dtype=qc.dtype, device=qc.device).expand(BH, K, K)
        pair_start = torch.cat([qc.new_zeros(BH, K, V), eye], -1).unsqueeze(0)
    last_run = ChunkRun(
        ((0, num_chunks - last_first),), (0 if through else -1,), V + K * through, own_output, True, decay_bound
    )
    parts = [x[last_first:] for x in (qc, kc, vc, gc, bc)]
    o_last, leaving = run_chunks(last_run, *parts, pair_start)
    b = leaving[0, ..., :V]
    A = leaving[0, ..., V:] if through else b.new_zeros(BH, K, K)
    entering_state = _entering_state(A, b, context)  # [B*H, K, V]: the scan's, read where a document continues
    if own_output and len(segments) == 1:
        o = o_last
    else:  # the documents before the last (or the only one, continuing): the first from the scan's state
        before = tuple(segments[:-1]) if own_output else tuple(segments)
        first_start = (0,) if context.continues else (-1,)
        run = ChunkRun(before, first_start + (-1,) * (len(before) - 1), V, True, False, decay_bound)
        end = last_first if own_output else num_chunks
        start = entering_state.unsqueeze(0) if context.continues else None
        o, _ = run_chunks(run, *(x[:end] for x in (qc, kc, vc, gc, bc)), start)
        if own_output:
            o = torch.cat([o, o_last])
    if not context.continues:
        o = join_backward(o, entering_state)
    return layout.from_chunks(o, dims.heads).to(v.dtype)


def _next_continues(context: ContextSlice) -> bool:
    """Whether the document holding this slice's last token goes on into the next rank's slice."""
    return context.rank + 1 < context.size and context.document_start(context.end) < context.end


def _entering_state(A: torch.Tensor, b: torch.Tensor, context: ContextSlice) -> torch.Tensor:
    """The state ``[B*H, K, V]`` entering this slice from a zero state before rank 0: the predecessors' pairs
    ``A`` ``[B*H, K, K]``, ``b`` ``[B*H, K, V]`` composed by a prefix scan over the group (module docstring)."""
    return _AffineScan.apply(A, b, context)


def _compose(pair: torch.Tensor, inner: torch.Tensor, key_dim: int) -> torch.Tensor:
    """``(A, b) o (A', b') = (A A', A b' + b)``, pairs ``[B*H, K, K + V]``: ``inner`` applied first."""
    outer = pair[..., :key_dim]
    return torch.cat(
        [torch.bmm(outer, inner[..., :key_dim]), torch.baddbmm(pair[..., key_dim:], outer, inner[..., key_dim:])], -1
    )


def _inclusive_scan(pair: torch.Tensor, context: ContextSlice, direction: int) -> torch.Tensor:
    """Every rank's composition of its own map after those of all ranks before it (``direction`` 1: lower
    ranks, applied first) or after it (-1: higher ranks): Hillis-Steele, ``log2(size)`` rounds of one shift each,
    two pairs held at a time. Collective; no autograd (``_AffineScan`` is the derivative)."""
    key_dim = pair.shape[-2]
    distance = 1
    while distance < context.size:
        inner = context.shifted(pair, direction * distance)
        if 0 <= context.rank - direction * distance < context.size:
            pair = _compose(pair, inner, key_dim)
        distance *= 2
    return pair


class _AffineScan(torch.autograd.Function):
    """``entering_r = (M_{r-1} o ... o M_0)(0)`` with ``M_j(S) = A_j S + b_j`` over the context group.

    Backward is the adjoint scan, from the other end: with ``G_r`` the gradient of ``entering_r``, the gradient
    of the state leaving rank j is ``E_j = G_{j+1} + A_{j+1}^T E_{j+1}`` (a suffix scan of the maps
    ``(A_{j+1}^T, G_{j+1})``), and ``dA_j = E_j entering_j^T``, ``db_j = E_j``. Only ``A`` and the entering
    state are saved: a rank keeps none of the other ranks' pairs between forward and backward."""

    @staticmethod
    def forward(ctx, A: torch.Tensor, b: torch.Tensor, context: ContextSlice) -> torch.Tensor:
        key_dim = A.shape[-1]
        leaving = _inclusive_scan(torch.cat([A, b], -1), context, 1)[..., key_dim:]  # from a zero state
        entering = context.shifted(leaving.contiguous(), 1)
        ctx.context = context
        ctx.save_for_backward(A, entering)
        return entering

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        A, entering = ctx.saved_tensors
        context, key_dim = ctx.context, A.shape[-1]
        grad = grad.to(A.dtype)
        # rank j's map is (A_{j+1}^T, G_{j+1}): the next rank's (zeros on the last rank, whose E is zero)
        after = context.shifted(torch.cat([A.transpose(-1, -2), grad], -1).contiguous(), -1)
        leaving_grad = _inclusive_scan(after, context, -1)[..., key_dim:]  # E_j
        return torch.bmm(leaving_grad, entering.transpose(-1, -2)), leaving_grad, None
