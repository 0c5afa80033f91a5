"""The routed experts: one GLU per expert over its contiguous block of sorted token copies.

Weights are stacked per kind in ``nn.Linear`` orientation (``[E, out, in]``), so a checkpoint's per-expert
``experts.{e}.w1`` tensors stack directly. The fast path is torch's grouped matmul (one call per weight
kind for all experts, forward and backward; it runs on the CPU in torch 2.13); the reference loops over
experts, never over tokens, and is also the fallback where grouped matmul is unavailable.
"""

from __future__ import annotations

import torch

from ..activations import glu, glu_packed
from ..checks import check_same_dtype, check_tensor
from ..debug import debug_checks
from .grouped_mm import grouped_mm, grouped_mm_supported


def grouped_glu(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "situ",
    beta: float = 4.0,
    linear_beta: float = 25.0,
) -> torch.Tensor:
    """``w2_e act(w1_e x, w3_e x)`` for each row x of expert e's block.

    x_sorted: ``[M, Din]`` rows sorted by expert (``permute``'s output); tokens_per_expert: ``[E]`` block
    sizes summing to M; w1 (gate), w3 (up): ``[E, F, Din]``; w2 (down): ``[E, Din, F]``.
    Returns ``[M, Din]``. ``activation`` is "situ" (with ``beta``, ``linear_beta``) or "swiglu".
    """
    _check_expert_args(x_sorted, tokens_per_expert, w1, w3, w2)
    if not grouped_mm_supported(x_sorted, w2):
        return grouped_glu_reference(x_sorted, tokens_per_expert, w1, w3, w2, activation, beta, linear_beta)
    offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    # One grouped matmul against [w1; w3] reads each token row once for both projections; the weight
    # concat costs one pass over the expert weights, small next to the M-row products.
    gate_up = grouped_mm(x_sorted, torch.cat([w1, w3], 1).transpose(1, 2), offs)
    h = glu_packed(activation, gate_up, beta=beta, linear_beta=linear_beta)
    return grouped_mm(h, w2.transpose(1, 2), offs)


def grouped_glu_reference(
    x_sorted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "situ",
    beta: float = 4.0,
    linear_beta: float = 25.0,
) -> torch.Tensor:
    """Same contract as ``grouped_glu``, as a plain loop over experts on their contiguous row blocks."""
    _check_expert_args(x_sorted, tokens_per_expert, w1, w3, w2)
    blocks = x_sorted.split(tokens_per_expert.tolist())
    # unbind (not w1[e]) so backward stacks one gradient per expert instead of adding E full-size zeros.
    outs = [
        (glu(activation, xe @ g.t(), xe @ u.t(), beta=beta, linear_beta=linear_beta)) @ d.t()
        for xe, g, u, d in zip(blocks, w1.unbind(0), w3.unbind(0), w2.unbind(0))
    ]
    return torch.cat(outs) if outs else x_sorted.new_zeros(0, x_sorted.shape[1])


def _check_expert_args(x_sorted, tokens_per_expert, w1, w3, w2) -> None:
    check_tensor("x_sorted", x_sorted, ndim=2, floating=True)
    check_tensor("w1", w1, ndim=3, floating=True)
    e, f, din = w1.shape
    if din != x_sorted.shape[1]:
        raise ValueError(
            f"w1: expected [E, F, Din] with Din = x_sorted width ({x_sorted.shape[1]}), got {tuple(w1.shape)}"
        )
    check_tensor("w3", w3, shape=(e, f, din), floating=True)
    check_tensor("w2", w2, shape=(e, din, f), floating=True)
    check_same_dtype(x_sorted=x_sorted, w1=w1, w3=w3, w2=w2)
    check_tensor("tokens_per_expert", tokens_per_expert, shape=(e,))
    if tokens_per_expert.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens_per_expert: expected an int32/int64 tensor, got {tokens_per_expert.dtype}")
    if not debug_checks() or tokens_per_expert.is_meta:  # the values below are host reads: debug mode only
        return
    total = int(tokens_per_expert.sum())
    if total != x_sorted.shape[0] or (e and int(tokens_per_expert.min()) < 0):
        raise ValueError(
            f"tokens_per_expert: expected non-negative counts summing to x_sorted rows "
            f"({x_sorted.shape[0]}), got sum {total}"
        )
