"""The routed experts' stacked GLU weights (``StackedExperts``), apart from ``layers.moe`` so that the packed
experts (``layers.packed_experts``) build on them and ``layers.moe`` picks either without an import circle."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..compat.deepspeed import full_shape
from ..ops.moe import grouped_glu

__all__ = ["StackedExperts"]

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (layer seed, expert) pairs over the seed space


class StackedExperts(nn.Module):
    """``experts``: routed experts' GLU weights stacked, ``w1``/``w3`` ``[E, F, L]`` and ``w2`` ``[E, L, F]``.

    seed: None draws the initial weights from torch's global generator (one device). Otherwise stacked expert
    j is global expert ``first_expert + j`` and is drawn from its own generator seeded by (seed, global
    index), so an expert starts the same whichever expert-parallel rank holds it (EP=n equals EP=1).
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        intermediate: int,
        activation: str = "situ",
        situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        seed: Optional[int] = None,
        first_expert: int = 0,
    ):
        super().__init__()
        self.activation = activation
        self.situ_beta = situ_beta
        self.situ_linear_beta = situ_linear_beta
        self.seed, self.first_expert = seed, first_expert
        kw = dict(dtype=dtype, device=device)
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, dim, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # nn.Linear's default scale per expert: uniform in +-1/sqrt(fan_in).
        if self.seed is None:
            for w in (self.w1, self.w3, self.w2):
                bound = 1.0 / math.sqrt(w.shape[2])
                nn.init.uniform_(w, -bound, bound)
            return
        if self.w1.is_meta:
            return
        for j in range(self.w1.shape[0]):
            g = torch.Generator(device=self.w1.device)
            g.manual_seed((self.seed + (self.first_expert + j) * _SEED_MIX) % 2**63)
            for w in (self.w1, self.w3, self.w2):
                bound = 1.0 / math.sqrt(w.shape[2])
                w[j].uniform_(-bound, bound, generator=g)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_sorted: ``[M, L]`` rows grouped by expert; tokens_per_expert: ``[E]`` -> ``[M, L]``."""
        return grouped_glu(
            x_sorted,
            tokens_per_expert,
            self.w1,
            self.w3,
            self.w2,
            self.activation,
            beta=self.situ_beta,
            linear_beta=self.situ_linear_beta,
        )

    def extra_repr(self) -> str:
        # a ZeRO-3 partitioned parameter's own shape is (0,): its full shape is ZeRO-3's ds_shape
        e, f, dim = full_shape(self.w1)
        return f"num_experts={e}, dim={dim}, intermediate={f}, activation={self.activation!r}"
