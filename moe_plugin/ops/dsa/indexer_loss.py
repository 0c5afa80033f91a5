"""The indexer's training signal: KL divergence from the (detached) dense attention to the index scores.

``attention_target`` gives ``p_t``: each head's causal softmax attention, summed over heads and L1-normalised
per query. ``indexer_kl_loss`` is ``mean_t KL(p_t || softmax(I_t))`` (docs/architecture.md 2.2); with ``indices``
both distributions are first restricted to (and renormalised over) each query's selected keys, as in the
sparse-training phase after the warm-up.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..checks import check_tensor
from .attention import check_indices, check_attention_inputs
from .masks import check_key_mask, check_positions, visible_keys


@torch.no_grad()
def attention_target(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    cu_seqlens: Optional[torch.Tensor] = None,
    query_offset: int = 0,
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense causal attention probabilities summed over heads and L1-normalised per query.

    q: ``[B, T, H, D]``; k: ``[B, S, H, D]`` (detached: this is a target); key_mask: ``[B, S]`` bool, False =
    a key never seen (padding). Returns ``[B, T, S]`` (rows sum to 1, or are 0 for a query that sees no key;
    0 at invisible keys). Heads are accumulated one at a time, so memory is ``B * T * S``.
    """
    check_attention_inputs(q, k, k, scale)
    B, T, H, _ = q.shape
    S = k.shape[1]
    check_positions(query_offset, B, T, S, cu_seqlens)
    check_key_mask(key_mask, B, S)
    visible = visible_keys(T, S, query_offset, cu_seqlens, key_mask, q.device)
    total = q.new_zeros(B, T, S)
    for h in range(H):
        scores = torch.matmul(q[:, :, h], k[:, :, h].transpose(1, 2)) * scale
        total += torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).nan_to_num_(0.0)
    return total / total.sum(-1, keepdim=True).clamp_min(torch.finfo(total.dtype).tiny)


def indexer_kl_loss(
    index_scores: torch.Tensor, attn_probs: torch.Tensor, indices: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``mean over the B*T queries of sum_s p[t,s] * (log p[t,s] - log softmax(I[t])_s)``, a scalar.

    index_scores: ``[B, T, S]`` (``-inf`` at invisible keys, e.g. from ``indexer_scores``); attn_probs:
    ``[B, T, S]`` target rows summing to 1 (``attention_target``); indices: optional ``[B, T, k]`` selected
    keys (``-1`` = empty). Terms with ``p = 0`` contribute 0. With ``indices`` the sum runs over the selected
    keys only, with ``p`` and ``softmax(I)`` renormalised over them. A query without any key (possible only
    with ``indices``) contributes 0 but still counts in the mean. Differentiable in ``index_scores``.
    """
    check_tensor("index_scores", index_scores, ndim=3, floating=True)
    check_tensor("attn_probs", attn_probs, shape=tuple(index_scores.shape), floating=True)
    if attn_probs.dtype != index_scores.dtype:
        raise ValueError(f"attn_probs: expected dtype {index_scores.dtype} (as index_scores), got {attn_probs.dtype}")
    p, scores = attn_probs, index_scores
    if indices is not None:
        B, T, S = index_scores.shape
        check_indices(indices, B, T, S)
        idx = indices.long()
        selected = torch.zeros(B, T, S + 1, dtype=torch.bool, device=scores.device)
        selected.scatter_(2, torch.where(idx >= 0, idx, S), True)
        selected = selected[..., :S]
        scores = scores.masked_fill(~selected, -math.inf)
        p = torch.where(selected, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    log_q = torch.log_softmax(scores, dim=-1)
    positive = p > 0
    # where() on both sides keeps 0 * log 0 (and 0 * -inf at unselected keys) out of the value and the gradient.
    terms = torch.where(
        positive, p * (torch.log(torch.where(positive, p, 1.0)) - torch.where(positive, log_q, 0.0)), 0.0
    )
    return terms.sum(-1).mean()
