"""Expert routing during training: balancing the selection bias, and watching LoRA move the router.

docs/architecture.md 3: with every base weight trainable, the selection bias ``e_score_correction_bias`` is
moved toward balance after each global batch (no auxiliary loss). In LoRA fine-tuning the router and its
bias are frozen, but an adapter on ``gate`` changes the routing, so the share of expert choices that
differ from the base router's is logged instead.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ..layers.moe import LatentMoEMixin, route_logits


def moe_layers(model: nn.Module) -> List[LatentMoEMixin]:
    """The model's MoE layers in forward order (the order of the rows of ``expert_load``): the single-device
    ``StableLatentMoE`` and megatron's ``LatentMoELayer`` alike (both are ``LatentMoEMixin``s)."""
    return [m for m in model.modules() if isinstance(m, LatentMoEMixin)]


@torch.no_grad()
def balance_experts(model: nn.Module, expert_load: torch.Tensor, method: str = "sign") -> float:
    """Update each MoE layer's selection bias from its row of ``expert_load`` ``[num_moe_layers, E]``.

    Sum the loads of a whole global batch (all micro-batches and data-parallel ranks) before calling; on a
    megatron model the rows are the layers' ``pop_load()``, all-reduced over the data-parallel group (see
    ``LatentMoEMixin``), and every rank calls this with the same rows.
    Returns the worst max/mean load ratio over the layers before the update (1.0 is perfect balance).
    """
    layers = moe_layers(model)
    if expert_load.shape[0] != len(layers):
        raise ValueError(f"expert_load: expected one row per MoE layer ({len(layers)}), got "
                         f"{tuple(expert_load.shape)}")
    for layer, load in zip(layers, expert_load):
        layer.update_routing_bias(load, method=method)
    return float((expert_load.max(1).values / expert_load.mean(1).clamp_min(1e-9)).max())


class RoutingDriftMonitor:
    """Fraction of (token, slot) expert choices that differ from the base router's, per forward pass.

    Hooks every MoE ``gate`` that peft has wrapped in a LoRA layer (it has a ``base_layer``): the wrapped
    router's logits are compared with the base router's on the same input, both steered by the same bias.
    """

    def __init__(self, model: nn.Module):
        self._drifts: List[float] = []
        self._handles = []
        for layer in moe_layers(model):
            if hasattr(layer.gate, "base_layer"):
                self._handles.append(layer.gate.register_forward_hook(self._hook(layer)))

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _hook(self, layer: LatentMoEMixin):
        @torch.no_grad()
        def hook(gate, inputs, logits):
            def choice(x):
                _, idx, _ = route_logits(layer.moe_config, x, layer.router.e_score_correction_bias)
                return idx.sort(-1).values

            adapted, base = choice(logits), choice(gate.base_layer(inputs[0]))
            same = (adapted.unsqueeze(-1) == base.unsqueeze(-2)).any(-1).float().mean()
            self._drifts.append(1.0 - float(same))

        return hook

    def pop(self) -> Optional[float]:
        """Mean drift over the forward passes since the last call, or None if none ran."""
        if not self._drifts:
            return None
        value = sum(self._drifts) / len(self._drifts)
        self._drifts.clear()
        return value

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
