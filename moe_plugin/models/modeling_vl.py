"""Image + text model: the vision tower's merged, projected patches replace the image placeholders' embeddings.

Names follow K3's multimodal checkpoint: ``language_model.*`` (the causal LM), ``vision_tower.*`` and
``mm_projector.*``. ``scatter_image_tokens`` is the one placement of image tokens, also used by megatron's
``MultimodalGPTModel``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from transformers import GenerationMixin

from ..config import require
from ..ops.context import ContextSlice
from ..layers.vision_encoder import build_image_encoder, encode_images
from .cache import HybridCache
from .configuration import MoEPluginConfig
from .image_tokens import expand_image_placeholders, tokens_per_image
from .inputs import check_inputs, check_labels
from .modeling import MoECausalLMOutput, MoEPluginForCausalLM, MoEPluginPreTrainedModel

__all__ = ["MoEPluginForConditionalGeneration", "scatter_image_tokens"]


def scatter_image_tokens(
    embeds: torch.Tensor,
    input_ids: torch.LongTensor,
    image_token_id: int,
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pixel_patches: Optional[torch.Tensor],
    grid_hw: Optional[torch.Tensor],
    image_tokens: Optional[slice] = None,
) -> torch.Tensor:
    """``embeds`` ``[B, T, D]`` with the placeholders of ``input_ids`` ``[B, T]`` replaced, in row-major order over
    ``[B, T]`` (the order MoEProcessor expanded them in), by ``encode(pixel_patches, grid_hw)`` ``[count, D]``.
    Without ``pixel_patches`` the embeddings are returned as they are, and no placeholder may be there.

    image_tokens: under context parallelism ``input_ids`` are this rank's slice of a row and the images the
    whole row's (an image's tokens may be split across ranks): the slice's placeholders take the row's image
    tokens ``image_tokens`` (``training.context_rows``), and the rest add zero, so a slice holding none of them
    still gives the vision tower its (zero) gradients."""
    placeholders = input_ids == image_token_id
    count = int(placeholders.sum())
    if pixel_patches is None:
        require(
            count == 0,
            "pixel_patches",
            f"input_ids hold {count} image placeholders but no image was "
            "given; pass the batch's pixel_patches and grid_hw",
        )
        return embeds
    require(grid_hw is not None, "grid_hw", "is required with pixel_patches ([num_images, 2] patch rows and columns)")
    every = tokens = encode(pixel_patches.to(embeds.device), grid_hw.to(embeds.device))
    if image_tokens is not None:
        tokens = every[image_tokens]
    require(
        tokens.shape[0] == count,
        "input_ids",
        f"{count} image placeholders for {tokens.shape[0]} image tokens; expand the placeholders with MoEProcessor "
        "or moe_plugin.models.image_tokens.expand_image_placeholders (one per image token)",
    )
    merged = embeds.masked_scatter(placeholders.unsqueeze(-1), tokens.to(embeds.dtype))
    if image_tokens is not None:
        merged = merged + every.float().sum().to(merged.dtype) * 0.0
    return merged


class MoEPluginForConditionalGeneration(MoEPluginPreTrainedModel, GenerationMixin):
    base_model_prefix = "language_model"

    def __init__(self, config: MoEPluginConfig):
        super().__init__(config)
        vision = config.to_model_config().vision
        if vision is None:
            raise ValueError("vision_config: the image+text model needs a vision_config (see presets)")
        self.language_model = MoEPluginForCausalLM(config)
        self.vision_tower, self.patch_merger, self.mm_projector = build_image_encoder(vision)
        self.post_init()
        self.generation_rules()

    def generation_rules(self) -> None:
        # A generated placeholder would be an image slot without an image on the next step: never emit one.
        if self.generation_config is not None:
            suppressed = set(self.generation_config.suppress_tokens or ()) | {self.config.image_token_id}
            self.generation_config.suppress_tokens = sorted(suppressed)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def embed(
        self,
        input_ids: torch.LongTensor,
        pixel_patches: Optional[torch.Tensor] = None,
        grid_hw: Optional[torch.Tensor] = None,
        image_tokens: Optional[slice] = None,
    ) -> torch.Tensor:
        """Token embeddings ``[B, T, D]`` with every image placeholder replaced, in order, by an image token
        (``image_tokens``: as ``scatter_image_tokens`` takes it)."""
        return scatter_image_tokens(
            self.language_model.model.embed_tokens(input_ids),
            input_ids,
            self.config.image_token_id,
            self.encode_images,
            pixel_patches,
            grid_hw,
            image_tokens,
        )

    def encode_images(self, pixel_patches: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
        """pixel_patches ``[N, C * P * P]`` (moonvit3d: or ``[N, C, P, P]``), grid_hw ``[num_images, 2]`` (moonvit3d:
        or ``[num_images, 3]``, K3's grid_thws) -> image tokens ``[N / m^2, hidden]``."""
        return encode_images(self.vision_tower, self.patch_merger, self.mm_projector, pixel_patches, grid_hw)

    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_patches: Optional[torch.Tensor] = None,
        grid_hw: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        cache: Optional[HybridCache] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        logits_to_keep: int = 0,
        num_items_in_batch: Optional[int] = None,
        context: Optional[ContextSlice] = None,
        image_tokens: Optional[slice] = None,
        **kwargs,
    ) -> MoECausalLMOutput:
        """input_ids ``[B, T]``; pixel_patches ``[N, 3*14*14]``; grid_hw ``[num_images, 2]``; the other arguments
        as ``MoEPluginForCausalLM.forward`` (labels ``[B, T]`` unshifted, image placeholders never scored).
        Under context parallelism (``context``: input_ids this rank's slice, placeholders already expanded)
        ``image_tokens`` says which of the row's image tokens the slice's placeholders take
        (``scatter_image_tokens``).

        K3's names are taken too: ``pixel_values`` ``[N, 3, 14, 14]`` and ``grid_thws`` ``[num_images, 3]``. Input ids
        with one placeholder per image (K3's ``<|media_pad|>``) are expanded here to each image's tokens, their
        labels -100 there (``image_tokens.expand_image_placeholders``; not with a cache: expand the prompt first)."""
        pixel_patches, grid_hw = _k3_image_names(pixel_patches, grid_hw, kwargs)
        if pixel_patches is not None and grid_hw is not None and context is None:
            counts = tokens_per_image(grid_hw, self.language_model.model.model_config.vision.merge_size)
            expanded = expand_image_placeholders(
                input_ids, self.config.image_token_id, counts, attention_mask, labels, cu_seqlens, self._pad_id()
            )
            if expanded[0] is not input_ids:
                # a cache (generate) would hold the expanded length while the caller counts the given ids
                require(
                    cache is None and not use_cache,
                    "input_ids",
                    "hold one placeholder per image; with a cache (use_cache, generate) expand them first "
                    "(moe_plugin.models.image_tokens.expand_image_placeholders)",
                )
                input_ids, attention_mask, labels, cu_seqlens = expanded
        mc = self.language_model.model.model_config
        batch, length = check_inputs(
            input_ids, None, attention_mask, mc.vocab_size, mc.hidden_size, cache.seq_length if cache is not None else 0
        )
        if labels is not None:
            check_labels(labels, batch, length, mc.vocab_size, logits_to_keep)
            labels = labels.masked_fill(input_ids == self.config.image_token_id, -100)
        return self.language_model(
            inputs_embeds=self.embed(input_ids, pixel_patches, grid_hw, image_tokens),
            context=context,
            attention_mask=attention_mask,
            labels=labels,
            cache=cache,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
            logits_to_keep=logits_to_keep,
            num_items_in_batch=num_items_in_batch,
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: Optional[HybridCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        pixel_patches=None,
        grid_hw=None,
        **kwargs,
    ):
        pixel_patches, grid_hw = _k3_image_names(pixel_patches, grid_hw, kwargs)
        inputs = self.language_model.prepare_inputs_for_generation(
            input_ids, cache=cache, attention_mask=attention_mask, **kwargs
        )
        if cache is None or cache.seq_length == 0:  # images enter with the prompt only
            inputs.update(pixel_patches=pixel_patches, grid_hw=grid_hw)
        return inputs

    def _pad_id(self) -> int:
        pad = getattr(self.config, "pad_token_id", None)
        return pad if pad is not None else 0


def _k3_image_names(pixel_patches, grid_hw, kwargs):
    """(pixel_patches, grid_hw) from this project's names or K3's (``pixel_values``, ``grid_thws``), popped from
    ``kwargs``; both spellings of one input at once is a ValueError naming it."""
    values, thws = kwargs.pop("pixel_values", None), kwargs.pop("grid_thws", None)
    require(pixel_patches is None or values is None, "pixel_values", "give pixel_values or pixel_patches, not both")
    require(grid_hw is None or thws is None, "grid_thws", "give grid_thws or grid_hw, not both")
    return (pixel_patches if values is None else values), (grid_hw if thws is None else thws)
