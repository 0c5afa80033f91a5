"""What both backends need for image+text training (docs/multimodal.md 3): whether a run trains the image
model, and the Hugging Face image model as the trainer runs it."""

from __future__ import annotations

from typing import Optional

import torch

from ...config import require
from ...layers.vision_blank import blank_image_tokens
from ...models.modeling_vl import MoEPluginForConditionalGeneration
from ..data.pipeline import has_images

__all__ = ["wants_images", "ImageTextTrainingModel"]


def wants_images(recipe, model_config) -> bool:
    """The image model is built when the base has a vision tower and the data holds images; otherwise the text
    model (a text-only run of an image base never builds, loads or partitions the tower)."""
    if getattr(recipe.model, "ignore_vision", False):
        require(
            not has_images(recipe.data),
            "model.ignore_vision",
            "is true, so the base trains as its text model, but the data holds images; drop the images from the "
            "data or set model.ignore_vision to false",
        )
        return False
    return model_config.vision is not None and has_images(recipe.data)


class ImageTextTrainingModel(MoEPluginForConditionalGeneration):
    """``MoEPluginForConditionalGeneration`` whose embedding always calls the image encoder: on a micro-batch
    without images it encodes a blank image weighted by zero (``moe_plugin.layers.vision_blank``), so that
    under ZeRO-3 every data-parallel rank gathers and reduces the vision parameters in the same order. The
    values are those of the parent class; the names and checkpoints are the same."""

    def embed(
        self,
        input_ids: torch.LongTensor,
        pixel_patches: Optional[torch.Tensor] = None,
        grid_hw: Optional[torch.Tensor] = None,
        image_tokens: Optional[slice] = None,
    ) -> torch.Tensor:
        """Token embeddings ``[B, T, D]`` with the placeholders replaced (the parent's ``embed``)."""
        embeds = super().embed(input_ids, pixel_patches, grid_hw, image_tokens)
        if pixel_patches is not None:
            return embeds
        vision = self.config.to_model_config().vision
        return embeds + blank_image_tokens(self.encode_images, vision, embeds.device).to(embeds.dtype)
