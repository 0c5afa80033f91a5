"""Image + text model: the vision tower's merged, projected patches replace the image placeholders' embeddings.

Names follow K3's multimodal checkpoint: ``language_model.*`` (the causal LM), ``vision_tower.*`` and
``mm_projector.*``.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import GenerationMixin

from ..layers.vision import MultimodalProjector, PatchMerger, VisionTower
from .cache import HybridCache
from .configuration import MoEPluginConfig
from .inputs import check_inputs, check_labels
from .modeling import MoECausalLMOutput, MoEPluginForCausalLM, MoEPluginPreTrainedModel


class MoEPluginForConditionalGeneration(MoEPluginPreTrainedModel, GenerationMixin):
    base_model_prefix = "language_model"

    def __init__(self, config: MoEPluginConfig):
        super().__init__(config)
        vision = config.to_model_config().vision
        if vision is None:
            raise ValueError("vision_config: the image+text model needs a vision_config (see presets)")
        self.language_model = MoEPluginForCausalLM(config)
        self.vision_tower = VisionTower(vision)
        self.patch_merger = PatchMerger(vision)
        self.mm_projector = MultimodalProjector(vision)
        self.post_init()
        if self.generation_config is not None:
            # A generated placeholder would be an image slot without an image on the next step: never emit one.
            suppressed = set(self.generation_config.suppress_tokens or ()) | {config.image_token_id}
            self.generation_config.suppress_tokens = sorted(suppressed)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def embed(self, input_ids: torch.LongTensor, pixel_patches: Optional[torch.Tensor] = None,
              grid_hw: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token embeddings ``[B, T, D]`` with every image placeholder replaced, in order, by an image token."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        placeholders = input_ids == self.config.image_token_id
        count = int(placeholders.sum())
        if pixel_patches is None:
            if count:
                raise ValueError(f"pixel_patches: input_ids hold {count} image placeholders but no image was given")
            return embeds
        if grid_hw is None:
            raise ValueError("grid_hw: required with pixel_patches ([num_images, 2] patch rows and columns)")
        image_tokens = self.mm_projector(self.patch_merger(self.vision_tower(pixel_patches, grid_hw)))
        if image_tokens.shape[0] != count:
            raise ValueError(f"input_ids: {count} image placeholders for {image_tokens.shape[0]} image tokens; "
                             "expand the placeholders with MoEProcessor")
        return embeds.masked_scatter(placeholders.unsqueeze(-1), image_tokens.to(embeds.dtype))

    def forward(self, input_ids: torch.LongTensor, pixel_patches: Optional[torch.Tensor] = None,
                grid_hw: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, cache: Optional[HybridCache] = None,
                use_cache: Optional[bool] = None, cu_seqlens: Optional[torch.Tensor] = None,
                logits_to_keep: int = 0, num_items_in_batch: Optional[int] = None, **kwargs) -> MoECausalLMOutput:
        """input_ids ``[B, T]``; pixel_patches ``[N, 3*14*14]``; grid_hw ``[num_images, 2]``; the other arguments
        as ``MoEPluginForCausalLM.forward`` (labels ``[B, T]`` unshifted, image placeholders never scored)."""
        mc = self.language_model.model.model_config
        batch, length = check_inputs(input_ids, None, attention_mask, mc.vocab_size, mc.hidden_size,
                                     cache.seq_length if cache is not None else 0)
        if labels is not None:
            check_labels(labels, batch, length, mc.vocab_size, logits_to_keep)
            labels = labels.masked_fill(input_ids == self.config.image_token_id, -100)
        return self.language_model(
            inputs_embeds=self.embed(input_ids, pixel_patches, grid_hw), attention_mask=attention_mask,
            labels=labels, cache=cache, use_cache=use_cache, cu_seqlens=cu_seqlens, logits_to_keep=logits_to_keep,
            num_items_in_batch=num_items_in_batch)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, cache: Optional[HybridCache] = None,
                                      attention_mask: Optional[torch.Tensor] = None, pixel_patches=None,
                                      grid_hw=None, **kwargs):
        inputs = self.language_model.prepare_inputs_for_generation(input_ids, cache=cache,
                                                                   attention_mask=attention_mask, **kwargs)
        if cache is None or cache.seq_length == 0:  # images enter with the prompt only
            inputs.update(pixel_patches=pixel_patches, grid_hw=grid_hw)
        return inputs
