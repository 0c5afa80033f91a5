"""KDA over one rank's contiguous slice of a row under context parallelism (docs/context-parallel.md).

The state leaving a run of chunks is affine in the state entering it (``chunk.py``): the slice's last document,
run from a zero state, leaves ``S_out = A S_in + b``, with ``A`` ``[H, K, K]`` the product of its chunks'
transitions and ``b`` ``[H, K, V]`` its final state from zero. Every rank sends its pair in one all-gather
(the compute dtype, fp32 or wider; ``K (K + V)`` values per head, whatever the slice's length). A rank whose
first document began on an earlier rank ``j0`` folds the pairs from there, ``S = b_j0``, then
``S = A_j S + b_j`` for ``j0 < j < rank``, and runs its first document from that state; documents that begin
inside a slice start from zero where they begin. Backward is autograd's mirror of the same steps: the
gather's backward hands each rank the gradient of its own pair, so the exchange stays ``O(K (K + V))`` too.

The slice's documents come from ``context.offsets`` (host ints): nothing is read from the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_plugin.ops.context import ContextSlice, check_context_rows, join_backward
from moe_plugin.ops.kda.chunk import ChunkLayout, chunk_terms, scan_chunks
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
    terms = chunk_terms(qc * dims.scale, kc, vc, gc, bc, decay_bound)

    segments = layout.segments
    zero = qc.new_zeros(qc.shape[0] * dims.heads, dims.key_dim, dims.value_dim)
    last_entering, b = scan_chunks(terms, *segments[-1], zero)  # the pair's b, before the exchange
    # A is read only by successors whose document passes through this whole slice
    through = len(segments) == 1 and context.continues and _next_continues(context)
    A = _transition(terms, *segments[-1], zero.shape[-2]) if through else zero.new_zeros(*zero.shape[:2], zero.shape[1])
    pairs = context.gather(torch.cat([A, b], dim=-1))  # [size, B*H, K, K + V]

    start = _fold(pairs, context, dims.key_dim) if context.continues else zero
    if len(segments) == 1:
        entering = scan_chunks(terms, *segments[0], start)[0] if context.continues else last_entering
    else:
        entering = scan_chunks(terms, *segments[0], start)[0]
        for first, last in segments[1:-1]:
            entering += scan_chunks(terms, first, last, zero)[0]
        entering += last_entering
    o = terms.output(entering)
    if not context.continues:
        o = join_backward(o, pairs)
    return layout.from_chunks(o).to(v.dtype)


def _next_continues(context: ContextSlice) -> bool:
    """Whether the document holding this slice's last token goes on into the next rank's slice."""
    return context.rank + 1 < context.size and context.document_start(context.end) < context.end


def _transition(terms, first: int, last: int, key_dim: int) -> torch.Tensor:
    """``A = M_{last-1} ... M_first`` ``[B*H, K, K]``: how the state entering chunk ``first`` reaches past
    chunk ``last - 1``."""
    A = torch.eye(key_dim, dtype=terms.P.dtype, device=terms.P.device).expand(terms.Ms[0].shape).contiguous()
    for n in range(first, last):
        A = torch.bmm(terms.Ms[n], A)
    return A


def _fold(pairs: torch.Tensor, context: ContextSlice, key_dim: int) -> torch.Tensor:
    """The state ``[B*H, K, V]`` entering this slice: its first document's predecessors' pairs, folded in
    rank order from the rank where that document begins."""
    first_rank = context.document_start(context.start) // context.length
    state = pairs[first_rank][..., key_dim:]
    for j in range(first_rank + 1, context.rank):
        state = torch.baddbmm(pairs[j][..., key_dim:], pairs[j][..., :key_dim], state)
    return state
