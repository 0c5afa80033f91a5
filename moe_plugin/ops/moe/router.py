"""Sigmoid top-k routing with a selection bias and optional group-limited choice (docs/architecture.md 3)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..checks import check_tensor


def route(
    logits: torch.Tensor,
    top_k: int,
    bias: Optional[torch.Tensor] = None,
    renormalize: bool = True,
    scaling: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token and their mixing weights.

    logits: ``[N, E]`` router outputs; bias: ``[E]`` selection bias (``e_score_correction_bias``).
    Returns ``weights [N, k]`` fp32, ``indices [N, k]`` int64 (best first) and ``scores [N, E]`` fp32,
    the unbiased sigmoid scores (what the balancing ops and the auxiliary loss consume).

    The bias only steers the choice: the weights are the chosen *unbiased* scores, so balancing never
    changes how much an expert's output counts once it is chosen. With ``num_groups > 1`` the experts are
    split into equal contiguous groups, each group is ranked by the sum of its two best biased scores
    (DeepSeek-V3), and only the best ``topk_groups`` groups stay eligible; this bounds how many
    expert-parallel ranks a token visits.
    """
    check_tensor("logits", logits, ndim=2, floating=True)
    num_experts = logits.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an integer in [1, num_experts={num_experts}], got {top_k!r}")
    if bias is not None:
        check_tensor("bias", bias, shape=(num_experts,), floating=True)
    if not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups: expected a positive divisor of num_experts ({num_experts}), got {num_groups!r}")
    if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups: expected an integer in [1, num_groups={num_groups}], got {topk_groups!r}")
    per_group = num_experts // num_groups
    if top_k > topk_groups * per_group:
        raise ValueError(
            f"top_k: expected at most topk_groups * experts per group ({topk_groups * per_group}), got {top_k}"
        )

    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    if topk_groups < num_groups:
        choice = _mask_to_best_groups(choice, num_groups, topk_groups)
    indices = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, indices)
    if renormalize:
        # The tiny floor keeps an all-zero row (saturated logits) finite instead of NaN.
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, indices, scores


def _mask_to_best_groups(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """choice: ``[N, E]`` biased scores -> the same with experts outside the best groups set to -inf."""
    n, e = choice.shape
    grouped = choice.view(n, num_groups, e // num_groups)
    group_score = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(-1)  # [N, G]
    best = group_score.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)
