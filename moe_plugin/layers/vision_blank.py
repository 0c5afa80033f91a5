"""A blank image for the vision encoder on a batch without images (docs/multimodal.md 3).

Under ZeRO-3 every module call gathers that module's parameters with a collective over the data-parallel
group, and every backward reduces their gradients over it. A rank whose micro-batch has no image must still
call the tower, the merger and the projector, in the same order as its peers, or the collectives of the
ranks pair up wrongly. ``blank_image_tokens`` runs the encoder on the smallest image (one merged token of
zero pixels) and returns it weighted by zero: added to the embeddings it changes no value and gives every
vision parameter a zero gradient.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from ..config import VisionConfig

Encoder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def blank_image(config: VisionConfig, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(pixel_patches ``[m * m, C * P * P]`` zeros, grid_hw ``[[m, m]]``): one merged token's worth of patches."""
    m = config.merge_size
    return (
        torch.zeros(m * m, config.patch_dim, device=device),
        torch.tensor([[m, m]], device=device, dtype=torch.int64),
    )


def blank_image_tokens(encode: Encoder, config: VisionConfig, device: torch.device) -> torch.Tensor:
    """A scalar zero that depends on every vision parameter: ``0 * encode(blank image).sum()`` (fp32)."""
    return encode(*blank_image(config, device)).float().sum() * 0.0
