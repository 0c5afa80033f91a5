"""The multimodal processor: chat template, image placeholder expansion, tokenization and image patches.

Text holds one ``<|image|>`` per image; the processor expands the i-th placeholder (counted across the whole
batch, in order) to ``gh * gw / merge_size**2`` placeholder tokens, one per merged token of the i-th image,
so that the model can put the projector's outputs (``VisionEncoder``, same order) in their place.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Union

from transformers import BatchFeature

from .image_processing import ImageInput, ImageProcessor
from .image_tokens import tokens_per_image
from .k3_image_processing import image_outputs
from .tokenizer import ByteTokenizer

Message = Dict[str, object]


def check_messages(messages: Sequence[Message]) -> None:
    """Raise ValueError naming ``messages`` unless each is {"role": str, "content": str or list of items}."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages: message {i} must be a dict with a string 'role', got {message!r}")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(_valid_item(item) for item in content):
            raise ValueError(
                f"messages: message {i} content must be a string or a list of "
                f"{{'type': 'text', 'text': str}} / {{'type': 'image'}} items, got {content!r}"
            )


def _valid_item(item: object) -> bool:
    if not isinstance(item, dict):
        return False
    return item.get("type") == "image" or (item.get("type") == "text" and isinstance(item.get("text"), str))


class MoEProcessor:
    """A ``ByteTokenizer`` and an ``ImageProcessor`` together (a plain class: transformers' ProcessorMixin
    resolves its parts through the Auto registries, which this offline processor does not need)."""

    def __init__(self, tokenizer: Optional[ByteTokenizer] = None, image_processor: Optional[ImageProcessor] = None):
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.image_processor = image_processor if image_processor is not None else ImageProcessor()

    @property
    def image_token(self) -> str:
        return self.tokenizer.image_token

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.image_token_id

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """Messages [{"role", "content"}] (content: str or list of text/image items) -> prompt text."""
        check_messages(messages)
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def __call__(
        self,
        text: Union[str, Sequence[str]],
        images: Optional[Sequence[ImageInput]] = None,
        padding: Union[bool, str] = True,
        return_tensors: str = "pt",
        **tokenizer_kwargs,
    ) -> BatchFeature:
        """Text(s) with placeholders and the images they refer to, in order ->
        ``input_ids`` / ``attention_mask`` [batch, seq] and, with images, ``pixel_patches`` [N, C * P * P]
        and ``grid_hw`` [num_images, 2]."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("text: expected a string or a non-empty list of strings")
        if images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        placeholders = sum(t.count(self.image_token) for t in texts)
        num_images = len(images) if images else 0
        if placeholders != num_images:
            raise ValueError(
                f"images: the text holds {placeholders} {self.image_token} placeholders but "
                f"{num_images} images were given"
            )
        data = {}
        if num_images:
            vision = self.image_processor(images, return_tensors=return_tensors)
            data.update(vision)
            counts = tokens_per_image(image_outputs(vision)[1], self.image_processor.merge_size)
            texts = self._expand_placeholders(texts, counts)
        data.update(self.tokenizer(texts, padding=padding, return_tensors=return_tensors, **tokenizer_kwargs))
        return BatchFeature(data)

    def _expand_placeholders(self, texts: List[str], tokens_per_image: List[int]) -> List[str]:
        counts = iter(tokens_per_image)
        expanded = []
        for t in texts:
            pieces = t.split(self.image_token)
            out = [pieces[0]]
            for piece in pieces[1:]:
                out.append(self.image_token * next(counts))
                out.append(piece)
            expanded.append("".join(out))
        return expanded

    def decode(self, ids, **kwargs) -> str:
        return self.tokenizer.decode(ids, **kwargs)

    def batch_decode(self, ids, **kwargs) -> List[str]:
        return self.tokenizer.batch_decode(ids, **kwargs)

    def save_pretrained(self, save_directory: str) -> None:
        os.makedirs(save_directory, exist_ok=True)
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)

    @classmethod
    def from_pretrained(cls, directory: str) -> "MoEProcessor":
        return cls(ByteTokenizer.from_pretrained(directory), ImageProcessor.from_pretrained(directory))
