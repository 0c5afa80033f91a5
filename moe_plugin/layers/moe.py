"""Stable Latent MoE on one device (ARCHITECTURE.md 3), with K3's module names.

The forward is split into stages (``route``, ``to_latent``, ``experts``, ``from_latent``, ``shared_path``)
so that the expert-parallel adapter can put its all-to-all between ``permute`` and ``experts`` and reuse
everything else unchanged.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from ..ops.moe import (grouped_glu, permute, quantile_balance_bias, route, unpermute,
                       update_bias_sign)
from .mlp import GLUMLP
from .norm import RMSNorm

BIAS_METHODS = ("sign", "quantile")


class MoERouter(nn.Linear):
    """``gate``: fp32 router logits ``W_r x`` plus the selection bias buffer ``e_score_correction_bias``.

    A subclass of ``nn.Linear`` so that peft can put a LoRA adapter on it (the seed targets ``gate``).
    The bias is a persistent buffer: it is in the state dict (K3 checkpoints carry it) but no optimizer
    touches it; only ``StableLatentMoE.update_routing_bias`` changes it.
    """

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(hidden, num_experts, bias=False, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "e_score_correction_bias"):  # nn.Linear.__init__ calls this before the buffer exists
            with torch.no_grad():
                self.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[N, hidden]`` -> logits ``[N, E]`` fp32 (routing in bf16 flips near-tied choices)."""
        return F.linear(x.float(), self.weight.float())

    def _apply(self, fn, recurse=True):
        # Keep the router in exact fp32 through model.to(bfloat16) / .half(), as K3 does: a cast back after the
        # conversion would have rounded the values through bf16, so the fp32 originals are kept and put back
        # on the tensors' new device.
        originals = {"weight": self.weight.data, "e_score_correction_bias": self.e_score_correction_bias}
        super()._apply(fn, recurse)
        for name, original in originals.items():
            now = self.weight.data if name == "weight" else self.e_score_correction_bias
            if not now.is_floating_point() or now.dtype == torch.float32:
                continue
            # materialised from meta (to_empty) there are no values to keep, only the dtype
            kept = now.float() if original.is_meta and not now.is_meta else original.float().to(now.device)
            if name == "weight":
                self.weight.data = kept
            else:
                self.e_score_correction_bias = kept
        return self


class StackedExperts(nn.Module):
    """``experts``: all routed experts' GLU weights stacked, ``w1``/``w3`` ``[E, F, L]`` and ``w2`` ``[E, L, F]``."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, activation: str = "situ",
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
        super().__init__()
        self.activation = activation
        self.situ_beta = situ_beta
        self.situ_linear_beta = situ_linear_beta
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default scale per expert: uniform in +-1/sqrt(fan_in).
        for w in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(w.shape[2])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_sorted: ``[M, L]`` rows grouped by expert; tokens_per_expert: ``[E]`` -> ``[M, L]``."""
        return grouped_glu(x_sorted, tokens_per_expert, self.w1, self.w3, self.w2, self.activation,
                           beta=self.situ_beta, linear_beta=self.situ_linear_beta)

    def extra_repr(self) -> str:
        e, f, dim = self.w1.shape
        return f"num_experts={e}, dim={dim}, intermediate={f}, activation={self.activation!r}"


class StableLatentMoE(nn.Module):
    """Routed experts in a latent space with an RMSNorm on their combined output, plus shared experts.

    ``y = up(RMSNorm(sum_k w_k E_k(down(x)))) + shared(x)``; without ``latent_size`` the experts work on
    the hidden directly and there is no down/norm/up.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        c = config
        self.num_experts, self.top_k = c.num_experts, c.top_k
        self.gate = MoERouter(c.hidden_size, c.num_experts)
        self.experts = StackedExperts(c.num_experts, c.expert_dim, c.expert_intermediate_size, c.activation,
                                      c.situ_beta, c.situ_linear_beta)
        if c.latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(c.hidden_size, c.latent_size, bias=False)
            self.routed_expert_norm = RMSNorm(c.latent_size, c.norm_eps) if c.latent_norm else None
            self.routed_expert_up_proj = nn.Linear(c.latent_size, c.hidden_size, bias=False)
        if c.num_shared_experts > 0:
            self.shared_experts = GLUMLP(c.hidden_size, c.shared_intermediate_size, c.activation,
                                         c.situ_beta, c.situ_linear_beta)

    @property
    def router(self) -> MoERouter:
        """The ``MoERouter`` itself, also when peft has wrapped ``gate`` in a LoRA layer."""
        return getattr(self.gate, "base_layer", self.gate)

    def route(self, x_flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_flat: ``[N, hidden]`` -> weights ``[N, k]`` fp32, indices ``[N, k]`` int64, scores ``[N, E]`` fp32."""
        c = self.config
        return route(self.gate(x_flat).float(), c.top_k, bias=self.router.e_score_correction_bias,
                     renormalize=c.renormalize, scaling=c.routed_scaling_factor, num_groups=c.num_groups,
                     topk_groups=c.topk_groups)

    def to_latent(self, x_flat: torch.Tensor) -> torch.Tensor:
        """x_flat: ``[N, hidden]`` -> ``[N, expert_dim]`` (the tokens the experts, and the all-to-all, see)."""
        if self.config.latent_size is None:
            return x_flat
        return self.routed_expert_down_proj(x_flat)

    def from_latent(self, u: torch.Tensor) -> torch.Tensor:
        """u: ``[N, expert_dim]`` combined expert outputs -> ``[N, hidden]``."""
        if self.config.latent_size is None:
            return u
        if self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u)
        return self.routed_expert_up_proj(u)

    def shared_path(self, x_flat: torch.Tensor) -> Optional[torch.Tensor]:
        """x_flat: ``[N, hidden]`` -> ``[N, hidden]``, or None without shared experts."""
        return self.shared_experts(x_flat) if self.config.num_shared_experts > 0 else None

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """hidden_states: ``[B, T, hidden]`` -> ``(y [B, T, hidden], load [E])``.

        load is the detached float count of token copies each expert received in this call, to be summed
        over a global batch for ``update_routing_bias``.
        """
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, indices, _ = self.route(x)
        z_sorted, tokens_per_expert, order = permute(self.to_latent(x), indices, self.num_experts)
        u = unpermute(self.experts(z_sorted, tokens_per_expert), order, weights)
        y = self.from_latent(u)
        shared = self.shared_path(x)
        if shared is not None:
            y = y + shared
        return y.view(shape), tokens_per_expert.detach().float()

    @torch.no_grad()
    def update_routing_bias(self, load_or_scores: torch.Tensor, method: str = "sign") -> torch.Tensor:
        """Move ``gate.e_score_correction_bias`` toward balance, in place; returns the new ``[E]`` bias.

        method "sign": load_or_scores is the ``[E]`` load of a global batch (sum ``forward``'s loads over
        steps and data-parallel ranks first); rate ``config.bias_update_rate``.
        method "quantile": load_or_scores is ``[m, E]`` unbiased scores (``route``'s third output) of the batch.
        """
        bias = self.router.e_score_correction_bias
        if method == "sign":
            new = update_bias_sign(bias, load_or_scores, self.config.bias_update_rate)
        elif method == "quantile":
            new = quantile_balance_bias(load_or_scores, bias, self.top_k)
        else:
            raise ValueError(f"method: expected one of {BIAS_METHODS}, got {method!r}")
        bias.copy_(new)
        return bias.detach().clone()
