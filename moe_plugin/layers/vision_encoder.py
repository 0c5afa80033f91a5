"""The image encoder a ``VisionConfig`` asks for: tower, merge and projector, by ``kind`` (docs/multimodal.md 7).

Both faces (``moe_plugin.models.modeling_vl``, ``moe_plugin.megatron.multimodal``) build theirs here, so a kind
is added in one place. The three modules are owned by the model as ``vision_tower``, ``patch_merger`` (no
parameters) and ``mm_projector``; ``encode_images`` is the one composition both faces run.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from ..config import VisionConfig
from .moonvit import MoonViT3dTower, PatchMergerProjector, TemporalPatchMerger
from .vision import MultimodalProjector, PatchMerger, VisionTower

_KINDS = {
    "vit": (VisionTower, PatchMerger, MultimodalProjector),
    "moonvit3d": (MoonViT3dTower, TemporalPatchMerger, PatchMergerProjector),
}


def build_image_encoder(config: VisionConfig) -> Tuple[nn.Module, nn.Module, nn.Module]:
    """(vision_tower, patch_merger, mm_projector) of ``config.kind`` (``VisionConfig`` checks the kind)."""
    return tuple(cls(config) for cls in _KINDS[config.kind])


def encode_images(
    tower: nn.Module, merger: nn.Module, projector: nn.Module, pixels: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """pixels ``[N, C * P * P]`` (or ``[N, C, P, P]``), grid ``[num_images, 2 or 3]`` -> tokens ``[N / m^2, out]``
    (one image after another; with t frames an image has ``h * w / m^2``)."""
    return projector(merger(tower(pixels, grid), grid))


class ImageEncoder(nn.Module):
    """The three modules of ``config.kind`` as one module (``vision_tower``, ``patch_merger``, ``mm_projector``), for
    callers that hold the encoder alone (the planner): forward(pixels, grid) -> tokens ``[N / m^2, out]``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.vision_tower, self.patch_merger, self.mm_projector = build_image_encoder(config)

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return encode_images(self.vision_tower, self.patch_merger, self.mm_projector, pixels, grid)
