"""Routing, dispatch, experts and combine in one call: the routed-expert path as one pure function.

It is what ``StableLatentMoE`` computes with ``latent_size=None`` and no shared experts, for callers that
want the routed path without a module and for tests (tests/ops checks it against a per-token loop,
tests/layers/test_moe.py checks the layer equals it). The layer calls the stages itself, because expert
parallelism puts an all-to-all between ``permute`` and the experts.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..checks import check_tensor
from .experts import grouped_glu
from .permute import permute, unpermute
from .router import route


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    bias: Optional[torch.Tensor] = None,
    activation: str = "situ",
    renormalize: bool = True,
    scaling: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
    beta: float = 4.0,
    linear_beta: float = 25.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routed-expert output ``sum_k w_k E_k(x)`` per token (no shared experts, no latent projection).

    x: ``[N, D]``; router_weight: ``[E, D]`` (the router runs in fp32); bias: ``[E]`` selection bias;
    w1, w3: ``[E, F, D]``; w2: ``[E, D, F]``. Returns ``y [N, D]`` in x's dtype and
    ``tokens_per_expert [E]`` int64 (the load, for balancing).
    """
    check_tensor("x", x, ndim=2, floating=True)
    check_tensor("router_weight", router_weight, shape=(None, x.shape[1]), floating=True)
    check_tensor("w1", w1, ndim=3, floating=True)
    if router_weight.shape[0] != w1.shape[0]:
        raise ValueError(
            f"router_weight: expected one row per expert of w1 ({w1.shape[0]}), got {router_weight.shape[0]} rows"
        )
    logits = F.linear(x.float(), router_weight.float())
    weights, indices, _ = route(
        logits,
        top_k,
        bias=bias,
        renormalize=renormalize,
        scaling=scaling,
        num_groups=num_groups,
        topk_groups=topk_groups,
    )
    x_sorted, tokens_per_expert, order = permute(x, indices, router_weight.shape[0])
    y_sorted = grouped_glu(x_sorted, tokens_per_expert, w1, w3, w2, activation, beta=beta, linear_beta=linear_beta)
    return unpermute(y_sorted, order, weights), tokens_per_expert
