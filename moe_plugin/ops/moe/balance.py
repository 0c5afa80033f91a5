"""Load balancing: the auxiliary-loss-free bias updates and DeepSeek-V3's sequence-wise auxiliary loss.

The bias updates return a new ``[E]`` bias for ``route``'s ``bias`` argument; a bias shifted by a constant
routes identically, so the quantile rule re-centres its result to mean 0.
"""

from __future__ import annotations

import torch

from ..checks import check_ids, check_tensor


def expert_load(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """indices: ``[..., k]`` chosen expert ids -> ``[E]`` int64 number of token copies each expert received."""
    check_tensor("indices", indices)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive integer, got {num_experts!r}")
    check_ids("indices", indices, 0, num_experts, "expert ids")
    return torch.bincount(indices.reshape(-1).long(), minlength=num_experts)


def update_bias_sign(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's rule ``b_i + rate * sign(mean(load) - load_i)``: under-loaded experts become likelier.

    bias: ``[E]``; load: ``[E]`` token counts (any numeric dtype). Returns the new ``[E]`` bias in bias's dtype.
    """
    check_tensor("bias", bias, ndim=1, floating=True)
    check_tensor("load", load, shape=(bias.shape[0],))
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
        raise ValueError(f"rate: expected a non-negative number, got {rate!r}")
    load = load.float()
    return (bias.float() + rate * torch.sign(load.mean() - load)).to(bias.dtype)


def quantile_balance_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """K3's quantile balancing: the bias under which each expert would take about ``m k / n`` tokens.

    scores: ``[m, E]`` unbiased sigmoid scores (``route``'s third output) of a batch of m tokens;
    bias: ``[E]`` the current selection bias. Returns the new ``[E]`` bias (bias's dtype), mean 0.

    Token t's cutoff ``a_t`` is its (k+1)-th largest biased score: with the cutoffs held fixed, expert i
    wins token t exactly when ``s_ti + b_i > a_t``, i.e. when the margin ``s_ti - a_t`` exceeds ``-b_i``.
    Setting ``b_i`` to minus the expert's (q+1)-th largest margin lets exactly its q best-margin tokens
    through. The quota ``q = floor(m k / n)`` is rounded down, so no expert is set up for more than its
    share; the at most n-1 copies this leaves over go to whichever experts the cutoffs favour.
    """
    check_tensor("scores", scores, ndim=2, floating=True)
    m, n = scores.shape
    check_tensor("bias", bias, shape=(n,), floating=True)
    if not isinstance(top_k, int) or not 1 <= top_k < n:
        raise ValueError(f"top_k: expected an integer in [1, num_experts - 1 = {n - 1}] "
                         f"(the cutoff is the (k+1)-th score), got {top_k!r}")
    if m < 1:
        raise ValueError("scores: expected at least one token (m >= 1), got 0 rows")
    s = scores.float()
    cutoff = torch.topk(s + bias.float(), top_k + 1, dim=-1).values[:, top_k]  # [m]
    margins = s - cutoff.unsqueeze(1)
    quota = (m * top_k) // n
    # The (q+1)-th largest of m values is the (m-q)-th smallest.
    threshold = torch.kthvalue(margins, m - quota, dim=0).values
    new_bias = -threshold
    return (new_bias - new_bias.mean()).to(bias.dtype)


def sequence_aux_loss(scores: torch.Tensor, indices: torch.Tensor, alpha: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences.

    scores: ``[B, T, E]`` unbiased sigmoid scores; indices: ``[B, T, k]`` chosen experts. Per sequence,
    ``f_i = E / (k T) * count_i`` and ``P_i = mean_t s_ti / sum_j s_tj``; the loss is
    ``alpha * sum_i f_i P_i`` (a scalar), differentiable through the scores only.
    """
    check_tensor("scores", scores, ndim=3, floating=True)
    b, t, e = scores.shape
    check_tensor("indices", indices, shape=(b, t, None))
    check_ids("indices", indices, 0, e, "expert ids")
    k = indices.shape[2]
    counts = torch.zeros(b, e, device=scores.device, dtype=torch.float32)
    counts.scatter_add_(1, indices.reshape(b, -1).long(), torch.ones(b, t * k, device=scores.device))
    f = counts * (e / (k * t))
    s = scores.float()
    p = (s / s.sum(-1, keepdim=True)).mean(1)  # [B, E]
    return alpha * (f * p).sum(-1).mean()
