"""The image+text model on megatron-core: ``GPTModel`` with the vision tower and projector (docs/multimodal.md 1).

``MultimodalGPTModel`` is megatron's own ``GPTModel`` (the specs' decoder block, unchanged) that owns
``vision_tower``, ``patch_merger`` and ``mm_projector``, the single-device layers of ``moe_plugin.layers.vision``.
Its forward embeds the tokens with megatron's embedding, encodes the micro-batch's images, puts the merged image
tokens in place of the ``<|image|>`` placeholders (``moe_plugin.models.modeling_vl.scatter_image_tokens``, the
Hugging Face model's own placement) and hands the result to ``GPTModel.forward`` as ``decoder_input``.

The vision parameters are named ``vision_tower.*`` / ``mm_projector.*`` as in the Hugging Face checkpoint, so the
loader and the adapter export need no rule beyond ``moe_plugin.weights.names``. They are ordinary (non-expert)
parameters: ZeRO-3 partitions them over the data-parallel group, and every data-parallel rank encodes the images
of its own micro-batch. A micro-batch without images still calls the encoder on a blank image weighted by zero
(``moe_plugin.layers.vision_blank``), so ZeRO-3's gathers and reductions line up across ranks.

Pipeline stages: only the first stage embeds, so only it would own the encoder (``pre_process``); the others
receive ``decoder_input`` from the previous stage as today.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from ..compat.megatron import adopt_subclass
from ..config import ModelConfig, VisionConfig, require
from ..layers.vision_encoder import build_image_encoder, encode_images
from ..layers.vision_blank import blank_image_tokens
from ..models.modeling_vl import scatter_image_tokens
from .specs import build_gpt_model

__all__ = ["MultimodalGPTModel", "build_multimodal_gpt_model"]


class MultimodalGPTModel(GPTModel):
    """``GPTModel`` plus the image encoder; made by ``build_multimodal_gpt_model`` from the text model that
    ``build_gpt_model`` builds (so whatever decoder that is, Attention Residuals included, is not built twice).

    forward(input_ids ``[B, T]``, position_ids, attention_mask, ..., pixel_patches ``[N, C * P * P]``,
    grid_hw ``[num_images, 2]``) -> logits ``[B, T, V]`` (the other arguments as ``GPTModel.forward``).
    """

    vision: VisionConfig
    image_token_id: int

    def attach_encoder(self, vision: VisionConfig, image_token_id: int) -> None:
        """Build ``vision_tower``, ``patch_merger`` and ``mm_projector`` (under ``deepspeed.zero.Init`` when the
        caller builds in it, so they are partitioned like the rest)."""
        require(
            self.pre_process,
            "pre_process",
            "the image encoder lives on the first pipeline stage; build the other stages as plain GPTModel",
        )
        self.vision, self.image_token_id = vision, image_token_id
        self.vision_tower, self.patch_merger, self.mm_projector = build_image_encoder(vision)

    def encode_images(self, pixel_patches: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
        """pixel_patches ``[N, C * P * P]``, grid_hw ``[num_images, 2]`` (``vision.kind`` moonvit3d: K3's
        ``[N, C, P, P]`` and ``[num_images, 3]`` too) -> image tokens ``[N / m^2, hidden]``."""
        return encode_images(self.vision_tower, self.patch_merger, self.mm_projector, pixel_patches, grid_hw)

    def embed_with_images(
        self,
        input_ids: torch.LongTensor,
        pixel_patches: Optional[torch.Tensor],
        grid_hw: Optional[torch.Tensor],
        image_tokens: Optional[slice] = None,
    ) -> torch.Tensor:
        """megatron's token embeddings ``[T, B, D]`` with every placeholder replaced by an image token.

        image_tokens: under context parallelism ``input_ids`` are this rank's slice of the row and the images
        are the whole row's (an image's tokens may be split across ranks); the slice's placeholders take the
        row's image tokens ``image_tokens`` (those of the placeholders before the slice are skipped)."""
        embeds = self.embedding(input_ids=input_ids, position_ids=None)
        # the Hugging Face model's placement, on [B, T] (the order the processor expanded the placeholders in)
        merged = scatter_image_tokens(
            embeds.transpose(0, 1),
            input_ids,
            self.image_token_id,
            self.encode_images,
            pixel_patches,
            grid_hw,
            image_tokens,
        ).transpose(0, 1)
        if pixel_patches is None:
            merged = merged + blank_image_tokens(self.encode_images, self.vision, embeds.device).to(embeds.dtype)
        return merged.contiguous()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        decoder_input: Optional[torch.Tensor] = None,
        *args: Any,
        pixel_patches: Optional[torch.Tensor] = None,
        grid_hw: Optional[torch.Tensor] = None,
        image_tokens: Optional[slice] = None,
        **kwargs: Any,
    ):
        if decoder_input is None:
            decoder_input = self.embed_with_images(input_ids, pixel_patches, grid_hw, image_tokens)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)


def build_multimodal_gpt_model(
    config: ModelConfig, tc: TransformerConfig = None, **build_kwargs: Any
) -> MultimodalGPTModel:
    """``MultimodalGPTModel`` for ``config`` (which needs ``vision`` and ``image_token_id``): the text model of
    ``moe_plugin.megatron.specs.build_gpt_model(config, tc, **build_kwargs)``, turned into the subclass (it adds
    methods and the encoder, no state of ``GPTModel``'s own) and given the encoder. Start megatron's parallel
    state first."""
    require(isinstance(config, ModelConfig), "config", f"must be a ModelConfig, got {type(config).__name__}")
    require(
        config.vision is not None,
        "ModelConfig.vision",
        "is required for the image+text model; give the "
        "config a vision_config, or build the text model with build_gpt_model",
    )
    model = build_gpt_model(config, tc, **build_kwargs)
    adopt_subclass(model, MultimodalGPTModel)
    model.attach_encoder(config.vision, config.image_token_id)
    return model
