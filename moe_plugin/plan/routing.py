"""The planner's routing assumption, in the MoE layers' own dispatch slot (docs/planner.md, "Activations").

A meta tensor has no values, so the planner cannot route; it assumes balanced routing times a capacity factor.
On an expert-parallel rank holding ``E / EP`` experts every rank sends its share of its tokens' copies, so this
rank's experts receive ``N x top_k x capacity`` rows in equal blocks, and the combine takes ``N x top_k`` of
them back onto the N tokens. ``plan_routing`` gives a module's ``StableLatentMoE`` layers that dispatch
(``BalancedDispatch``, in place of their ``TokenDispatch``) and this rank's experts only, as expert
parallelism does, before the adapters go on, so that the adapters are this rank's too. The dispatch runs the
layer's own ops (``ops.moe``'s row copy and combine) on a fixed assignment, so it saves what the real one
saves, on meta or on any device; nothing is patched.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import nn

from ..config import require
from ..layers.moe import StableLatentMoE, TokenDispatch, experts_class, experts_kwargs
from ..ops.moe import replicate_rows, unpermute
from ..ops.offsets import counts_tensor

__all__ = ["BalancedDispatch", "kernels_device", "plan_routing"]


class BalancedDispatch(TokenDispatch):
    """Balanced routing on one rank: ``local_experts`` experts (>= 1) each receive an equal block of the
    ``N x top_k x capacity`` rows (``capacity`` >= 1, rounded up to whole blocks)."""

    def __init__(self, local_experts: int, capacity: float):
        require(
            isinstance(local_experts, int) and not isinstance(local_experts, bool) and local_experts >= 1,
            "local_experts",
            f"must be a positive int, got {local_experts!r}",
        )
        require(
            isinstance(capacity, (int, float)) and not isinstance(capacity, bool) and capacity >= 1,
            "capacity",
            f"must be a number >= 1 (the capacity factor over balanced routing), got {capacity!r}",
        )
        self.local_experts, self.capacity = local_experts, float(capacity)

    def rows(self, tokens: int, top_k: int) -> int:
        """The rows this rank's experts receive for ``tokens`` tokens of ``top_k`` copies."""
        per_expert = math.ceil(tokens * top_k * self.capacity / self.local_experts)
        return per_expert * self.local_experts

    def send(
        self, z: torch.Tensor, indices: torch.Tensor, num_experts: int
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z ``[N, L]``, indices ``[N, k]`` (only their shape is used) -> rows ``[M, L]``, counts
        ``[local_experts]`` (carrying their host copy) and the order ``[M]``: row p copies slot ``p mod N*k``
        (token ``(p mod N*k) // k``), so the first ``N*k`` rows are every token's k copies."""
        n, k = indices.shape
        m = self.rows(n, k)
        order = torch.arange(m, device=z.device) % max(n * k, 1)
        counts = counts_tensor([m // self.local_experts] * self.local_experts, device=z.device)
        return replicate_rows(z, order, k), counts, order

    def combine(self, y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The first ``N*k`` rows back onto the N tokens; the capacity's spare rows are dropped."""
        slots = weights.numel()
        return unpermute(y_sorted[:slots], order[:slots], weights)


def plan_routing(module: nn.Module, dispatch: BalancedDispatch) -> int:
    """Give every ``StableLatentMoE`` of ``module`` the ``dispatch`` and its first ``dispatch.local_experts``
    experts only (built anew where the old ones were, with their dtype: on meta that costs nothing). Call it
    before adding adapters. Returns the number of layers changed."""
    changed = 0
    for name, moe in module.named_modules():
        if not isinstance(moe, StableLatentMoE):
            continue
        c = moe.moe_config
        require(
            dispatch.local_experts <= c.num_experts,
            "local_experts",
            f"{dispatch.local_experts} is more than {name}'s {c.num_experts} experts",
        )
        old = moe.experts
        kwargs = dict(experts_kwargs(c), device=old.w1.device, dtype=getattr(old, "init_dtype", old.w1.dtype))
        if hasattr(old, "group_size"):  # packed experts: dequantised a group at a time, as the old ones
            kwargs["group_size"] = old.group_size
        args = (c.expert_dim, c.expert_intermediate_size, c.activation, c.situ_beta, c.situ_linear_beta)
        experts = experts_class(c)(dispatch.local_experts, *args, **kwargs)
        moe.experts = experts
        moe.dispatch = dispatch
        changed += 1
    return changed


def kernels_device(kernels: str) -> str:
    """The device ``ops.backend.planning_for`` takes for the planner's ``kernels`` (``"cpu"``: the torch paths
    as this machine runs them; ``"gpu"``: the kernels CUDA picks, counted by their meta stand-ins)."""
    require(kernels in ("cpu", "gpu"), "kernels", f"must be 'cpu' or 'gpu', got {kernels!r}")
    return "cuda" if kernels == "gpu" else "cpu"
