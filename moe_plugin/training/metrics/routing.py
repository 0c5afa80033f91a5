"""The model's MoE layers, found by type, for the loop's balancing and logging.

docs/architecture.md 3: with every base weight trainable, the selection bias ``e_score_correction_bias`` is
moved toward balance after each global batch (no auxiliary loss): the loop (``training.step_math.balance_loads``) sums
the layers' loads over the ranks and calls each layer's ``update_routing_bias``. The layers are found here so
that the single-device model and megatron's agree on their order.
"""

from __future__ import annotations

from typing import List

from torch import nn

from ...layers.moe import LatentMoEMixin


def moe_layers(model: nn.Module) -> List[LatentMoEMixin]:
    """The model's MoE layers in forward order (the order of the rows of ``expert_load``): the single-device
    ``StableLatentMoE`` and megatron's ``LatentMoELayer`` alike (both are ``LatentMoEMixin``s)."""
    return [m for m in model.modules() if isinstance(m, LatentMoEMixin)]
