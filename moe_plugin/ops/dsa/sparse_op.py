"""``sparse_attention``: DSA's sparse attention as the custom ops ``moe_plugin::sparse_attention`` (forward:
output and log-sum-exp) and ``moe_plugin::sparse_attention_backward`` (dq, dk, dv).

On CUDA tensors both run one Triton kernel launch each (``sparse_triton.py``, chosen by
``ops.backend.gpu_kernel``: no Python loop over query blocks, no host read). Elsewhere, the CPU above all,
they run the blocked kernel of ``attention.py`` (``blocked_forward`` / ``blocked_backward``), the fastest
measured there. Registered with ``torch.library`` they get fake kernels (tensors of the results' shapes) and
an autograd that saves q, k, v, the indices, the output and the log-sum-exp, so the planner runs the model on
``meta`` unpatched and ``torch.compile`` traces a DSA layer through the pair as two opaque ops: the block loop
and its host-int bounds (or the kernel launch) stay inside the eager kernels, out of dynamo's sight.

Host reads (issue 24) on the blocked path: each block's key span is a host int pair, found inside the kernels.
On ``indexer_topk``'s unchanged result it comes from the visible range that result carries
(``masks.recall_visible``: a Python attribute, which survives into a custom op's eager kernel and through
autograd's saved tensors; counted in ``tests/ops/test_dsa_host_reads.py``), so no read. Other indices:
``_block_spans`` finds every span with one reduction and one read in forward and leaves the host copy on the
indices tensor, where backward finds it: one read per call. Under ``torch.compile``, indices the compiled graph
makes itself (``indexer_topk`` traced in it) carry no visible range: one read per forward, none in backward;
indices passed in keep theirs.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..backend import gpu_kernel
from ..debug import debug_checks
from .attention import (
    DEFAULT_BLOCK,
    DEFAULT_KEY_CHUNK,
    BlockKeys,
    KeyPlan,
    _check_positive,
    blocked_backward,
    blocked_forward,
    check_attention_inputs,
    check_indices,
)
from .masks import recall_visible

__all__ = ["sparse_attention"]

_SPANS = "_moe_plugin_block_spans"
_TRITON = "moe_plugin.ops.dsa.sparse_triton"  # the CUDA kernels (module docstring)


def _block_spans(indices: torch.Tensor, block: int) -> List[List[Tuple[int, int]]]:
    """``[B][ceil(T / block)]`` spans ``(lo, hi)`` of the keys each block of queries selects (``hi <= lo``: none),
    all found with one reduction and brought to the host with one read."""
    B, T, k = indices.shape
    nb = -(-T // block)
    if T == 0 or k == 0:
        return [[(0, 0)] * nb for _ in range(B)]
    pad = nb * block - T
    idx = torch.nn.functional.pad(indices, (0, 0, 0, pad), value=-1) if pad else indices
    blocks = idx.reshape(B, nb, block * k)
    hi = blocks.amax(-1) + 1  # 0 for a block without a selection
    lo = torch.where(blocks >= 0, blocks, torch.iinfo(blocks.dtype).max).amin(-1)
    return [[(lo_, hi_) for lo_, hi_ in row] for row in torch.stack([lo, hi], -1).tolist()]


def _spans(indices: torch.Tensor, block: int, num_keys: int) -> List[List[Tuple[int, int]]]:
    """The block spans of ``indices`` ``[B, T, k]``: from ``indexer_topk``'s visible range (no read), from the
    copy an earlier pass left on this tensor (same block size, not changed in place since), or read once and
    left there for the backward."""
    B, T, _ = indices.shape
    seen = recall_visible(indices, num_keys)
    if seen is not None:  # indexer_topk's result: each block's keys lie in its queries' visible range
        return [[seen.span(t0, min(T, t0 + block)) for t0 in range(0, T, block)]] * B
    kept = getattr(indices, _SPANS, None)
    if kept is not None and kept[0] == indices._version and kept[1] == block:
        return kept[2]
    spans = _block_spans(indices.long(), block)
    setattr(indices, _SPANS, (indices._version, block, spans))
    return spans


def _selection_plan(indices: torch.Tensor, block: int, num_keys: int) -> KeyPlan:
    """Per block: the span from the smallest to the largest selected key, and each selection's column in it.

    The spans are host ints (``_spans``); everything per block stays on the device. With
    ``MOE_PLUGIN_DEBUG_CHECKS=1`` a repeated key in a query's row is refused."""
    spans = _spans(indices, block, num_keys)
    indices = indices.long()
    check_repeats = debug_checks()

    def plan(b: int, t0: int, t1: int) -> BlockKeys:
        idx = indices[b, t0:t1]  # [Bq, k]
        lo, hi = spans[b][t0 // block]
        if hi <= lo:
            return BlockKeys(0, 0, pos=idx)
        valid = idx >= 0
        pos = torch.where(valid, idx - lo, hi - lo)
        if check_repeats:
            seen = torch.zeros(idx.shape[0], hi - lo + 1, dtype=torch.bool, device=idx.device).scatter_(1, pos, True)
            if int(seen[:, :-1].sum()) != int(valid.sum()):
                raise ValueError(f"indices: a query of rows {t0}..{t1 - 1} (batch {b}) selects a key twice")
        return BlockKeys(lo, hi, pos=pos)

    return plan


def _check_no_repeats_in_debug(indices: torch.Tensor) -> None:
    """The kernel path's repeat check (the blocked path's is in its plan): with ``MOE_PLUGIN_DEBUG_CHECKS=1``,
    a key twice in a query's row of ``indices`` ``[B, T, k]`` is a ValueError (one sort and one read)."""
    if not debug_checks() or indices.shape[-1] < 2:
        return
    ordered = indices.sort(-1).values
    repeats = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(repeats.any()):
        b, t = (int(i) for i in repeats.any(-1).nonzero()[0])
        raise ValueError(f"indices: a query of row {t} (batch {b}) selects a key twice")


@torch.library.custom_op("moe_plugin::sparse_attention", mutates_args=())
def _sparse_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float, block: int, key_chunk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    kernel = gpu_kernel(_TRITON, "sparse_attention_triton", q, k, v, indices)
    if kernel is not None:
        _check_no_repeats_in_debug(indices)
        return kernel(q, k, v, indices, scale)
    plan = _selection_plan(indices, block, k.shape[1])
    return blocked_forward(q, k, v, scale, block, key_chunk, plan)


@_sparse_forward.register_fake
def _(q, k, v, indices, scale, block, key_chunk):
    # out [B, T, H, Dv], lse [B, T, H]
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3])


@torch.library.custom_op("moe_plugin::sparse_attention_backward", mutates_args=())
def _sparse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    block: int,
    key_chunk: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernel = gpu_kernel(_TRITON, "sparse_attention_triton_backward", grad_out, q, k, v, indices)
    if kernel is not None:
        return kernel(grad_out, q, k, v, indices, out, lse, scale)
    plan = _selection_plan(indices, block, k.shape[1])
    return blocked_backward(grad_out, q, k, v, out, lse, scale, block, key_chunk, plan)


@_sparse_backward.register_fake
def _(grad_out, q, k, v, indices, out, lse, scale, block, key_chunk):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, indices, scale, block, key_chunk = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    # what backward recomputes the blocks from; the indices also carry the host spans (module docstring)
    ctx.save_for_backward(q, k, v, indices, out, lse)
    ctx.scale, ctx.block, ctx.key_chunk = scale, block, key_chunk


def _backward(ctx, grad_out: torch.Tensor, _grad_lse: Optional[torch.Tensor]):
    q, k, v, indices, out, lse = ctx.saved_tensors
    dq, dk, dv = _sparse_backward(grad_out, q, k, v, indices, out, lse, ctx.scale, ctx.block, ctx.key_chunk)
    return dq, dk, dv, None, None, None, None


_sparse_forward.register_autograd(_backward, setup_context=_setup_context)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    block_size: int = DEFAULT_BLOCK,
    key_chunk: int = DEFAULT_KEY_CHUNK,
) -> torch.Tensor:
    """Each query attends (softmax) over its selected keys only.

    q: ``[B, T, H, Dqk]``; k: ``[B, S, H, Dqk]``; v: ``[B, S, H, Dv]``; indices: ``[B, T, k]`` int key
    positions, ``-1`` = empty slot, no key twice in a row (ValueError); scale: multiplies ``q . k``.
    Returns ``[B, T, H, Dv]``; a query with no selected key gets zeros. Differentiable in q, k, v with
    O(T*k) saved state (inputs, indices, output, log-sum-exp) and blocks of ``block_size`` queries recomputed
    in backward; transient memory ``O(H * block_size * key_chunk)`` in both passes. Causality is whatever the
    indices say (``indexer_topk`` only selects visible keys).
    """
    check_attention_inputs(q, k, v, scale)
    _check_positive("block_size", block_size)
    _check_positive("key_chunk", key_chunk)
    check_indices(indices, q.shape[0], q.shape[1], k.shape[1])
    out, _ = _sparse_forward(q, k, v, indices, float(scale), block_size, key_chunk)
    return out
