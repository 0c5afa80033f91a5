"""Token dispatch: sort token copies so each expert's rows are contiguous, and the weighted combine back.

Custom autograd functions below give both directions hand-written backwards: dispatch's gradient is one
``index_add_`` onto the tokens, and the combine's backward gathers the output gradient once per row for
both the rows' and the weights' gradients (generic indexing would backprop through zero-filled
scatters and a second gather).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..checks import check_ids_in_debug, check_tensor


def permute(
    x: torch.Tensor, indices: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert and sort the copies by expert.

    x: ``[N, D]``; indices: ``[N, k]`` expert ids. Returns ``x_sorted [N*k, D]``, ``tokens_per_expert [E]``
    int64 and ``order [N*k]`` int64, where ``x_sorted[p] = x[order[p] // k]`` and slot ``order[p]`` is
    token ``order[p] // k``'s choice ``order[p] % k``. The sort is stable, so within an expert the copies
    keep token order (deterministic results, and the order expert parallelism sends them in).
    """
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("indices", indices, shape=(x.shape[0], None))
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive integer, got {num_experts!r}")
    check_ids_in_debug("indices", indices, 0, num_experts, "expert ids")
    flat = indices.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    # counted into E slots: bincount sizes its output by the largest id, a host read
    tokens_per_expert = flat.new_zeros(num_experts).index_add_(0, flat, torch.ones_like(flat))
    x_sorted = _ReplicateRows.apply(x, order, indices.shape[1])
    return x_sorted, tokens_per_expert, order


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's ``k`` expert outputs.

    y_sorted: ``[N*k, D]`` expert outputs in ``permute``'s order; order: ``[N*k]`` from ``permute``;
    weights: ``[N, k]`` routing weights. Returns ``[N, D]`` in ``y_sorted``'s dtype:
    ``out[n] = sum_j weights[n, j] * y_sorted[p]`` with ``order[p] = n*k + j``.
    """
    check_tensor("y_sorted", y_sorted, ndim=2, floating=True)
    check_tensor("weights", weights, ndim=2, floating=True)
    check_tensor("order", order, shape=(y_sorted.shape[0],))
    # Range only (one min/max): a repeated position is not caught; permute's order never has one.
    check_ids_in_debug("order", order, 0, y_sorted.shape[0], "row positions")
    if weights.numel() != y_sorted.shape[0]:
        raise ValueError(
            f"weights: expected N*k = y_sorted rows ({y_sorted.shape[0]}) entries, got shape {tuple(weights.shape)}"
        )
    return _WeightedCombine.apply(y_sorted, order, weights)


def replicate_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x ``[N, D]`` -> ``[M, D]`` rows ``x[order[p] // k]`` (``permute``'s copy, for an ``order`` ``[M]`` made
    elsewhere: the planner's fixed assignment); its gradient adds each copy's back onto its token."""
    return _ReplicateRows.apply(x, order, k)


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """order: ``[M]`` a permutation -> ``[M]`` its inverse (``inv[order[p]] = p``)."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


class _ReplicateRows(torch.autograd.Function):
    """``x[order // k]``; the gradient adds each copy's gradient back onto its token."""

    @staticmethod
    def forward(ctx, x, order, k):
        token = torch.div(order, k, rounding_mode="floor")
        ctx.save_for_backward(token)
        ctx.rows = x.shape[0]
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        # One streaming pass (read N*k rows, accumulate into N); about 3x faster on the CPU than gathering
        # the copies back into token order and summing them.
        out = grad.new_zeros(ctx.rows, grad.shape[1])
        return out.index_add_(0, token, grad), None, None


class _WeightedCombine(torch.autograd.Function):
    """``out[n] = sum_j w[n, j] y[inv[n*k + j]]`` as one batched ``[1, k] @ [k, D]`` product per token.

    The backward works in sorted order: one gather of the output gradient per row serves both the
    rows' gradient (scaled by their weight) and the weights' gradient (its dot product with the row).
    """

    @staticmethod
    def forward(ctx, y_sorted, order, weights):
        n, k = weights.shape
        w = weights.to(y_sorted.dtype)
        slots = y_sorted.index_select(0, inverse_order(order)).view(n, k, -1)
        ctx.save_for_backward(y_sorted, order, w)
        ctx.weights_dtype = weights.dtype
        return torch.bmm(w.unsqueeze(1), slots).squeeze(1)

    @staticmethod
    def backward(ctx, grad):
        y_sorted, order, w = ctx.saved_tensors
        k = w.shape[1]
        grad_rows = grad.index_select(0, torch.div(order, k, rounding_mode="floor"))  # [N*k, D] sorted
        grad_y = grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = torch.empty(order.numel(), dtype=ctx.weights_dtype, device=order.device)
            grad_w[order] = torch.linalg.vecdot(grad_rows, y_sorted).to(ctx.weights_dtype)
            grad_w = grad_w.view(w.shape)
        if ctx.needs_input_grad[0]:
            grad_y = grad_rows.mul_(w.reshape(-1).index_select(0, order).unsqueeze(1))
        return grad_y, None, grad_w
