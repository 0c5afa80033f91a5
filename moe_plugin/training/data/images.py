"""The image side of image+text SFT data (docs/multimodal.md 2): where a record's images are, reading them,
and the patches that travel with a packed row.

A record names its images in one of two ways, never both:

- inline, as content items ``{"type": "image", "image": SOURCE}``: each item is one image placeholder token
  (the base's: ``ChatTokens.image_token``, ``<|image|>`` for the byte tokenizer) where the base's chat
  template renders it;
- a top-level ``"images": [SOURCE, ...]`` list filling, in order, the placeholders the conversation holds
  (``{"type": "image"}`` items without a source, or the placeholder token written in the text).

A SOURCE is a file path, relative to the data file's folder (or absolute), or a ``data:image/...;base64,``
URL. Every error names the data file and line (``where``) and the image.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import struct
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ...config import require

IMAGE_PLACEHOLDER = "<|image|>"  # the byte tokenizer's; the trainer takes the base's (ChatTokens.image_token)
_DATA_URL = "data:image/"


@dataclass
class Images:
    """The images of an example, a row or a micro-batch, in placeholder order: ``pixel_patches``
    ``[N, C * P * P]`` float32 and ``grid_hw`` ``[num_images, 2]`` int64 (``moe_plugin.layers.vision``'s layout)."""

    pixel_patches: torch.Tensor
    grid_hw: torch.Tensor
    # each image's original (width, height), where read from files: a format such as K3's writes it
    sizes: Optional[List[Tuple[int, int]]] = None

    def tokens_per_image(self, merge_size: int) -> List[int]:
        """Merged tokens of each image: ``h * w / merge_size**2`` (``grid_hw`` may be K3's ``[n, 3]`` (t, h, w))."""
        from ...models.image_tokens import tokens_per_image

        return tokens_per_image(self.grid_hw, merge_size)


def concat_images(parts: Sequence[Optional[Images]]) -> Optional[Images]:
    """The images of ``parts`` one after another (None where none has any)."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return Images(torch.cat([p.pixel_patches for p in present]), torch.cat([p.grid_hw for p in present]))


def image_sources(where: str, record: dict, inline: List[str]) -> List[str]:
    """The record's image sources in placeholder order: ``inline`` (from its image items) or its ``images`` list."""
    listed = record.get("images")
    if listed is None:
        return inline
    require(
        isinstance(listed, list) and all(isinstance(s, str) and s for s in listed),
        "data.path",
        f"{where}: 'images' must be a list of image paths or data:image/...;base64, URLs, got {listed!r:.80}",
    )
    require(
        not inline,
        "data.path",
        f"{where}: names images both inline (content items with 'image') and in an 'images' list; use one of the two",
    )
    return listed


def inline_source(at: str, item: dict) -> Optional[str]:
    """The source of an inline image item (None for a bare ``{"type": "image"}`` placeholder)."""
    source = item.get("image")
    if source is None and item.get("image_url") is not None:  # OpenAI's {"type": "image_url", "image_url": {"url"}}
        url = item["image_url"]
        source = url.get("url") if isinstance(url, dict) else url
    require(
        source is None or (isinstance(source, str) and bool(source)),
        "data.path",
        f"{at}: 'image' must be an image path or a data:image/...;base64, URL, got {source!r:.80}",
    )
    return source


def open_image(where: str, source: str, base_dir: str):
    """The PIL image of ``source``, fully read; a missing, unreadable or oversized image raises a ValueError
    naming both. PIL's pixel limit (``PIL.Image.MAX_IMAGE_PIXELS``) is kept as the caller set it: an image over
    it is refused here, even where PIL itself would only warn."""
    from PIL import Image

    shown = source if len(source) <= 60 else source[:57] + "..."
    if source.startswith(_DATA_URL):
        header, _, payload = source.partition(",")
        require(
            header.endswith(";base64") and bool(payload),
            "data.path",
            f"{where}: image {shown!r} is a data URL without base64 data; use data:image/png;base64,<data>",
        )
        try:
            handle = io.BytesIO(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as e:
            raise ValueError(
                f"data.path: {where}: image {shown!r} has invalid base64 data ({e}); encode the "
                "image bytes with standard base64 (A-Z, a-z, 0-9, +, /, = padding, no line breaks)"
            ) from None
    else:
        path = source if os.path.isabs(source) else os.path.join(base_dir, source)
        require(
            os.path.isfile(path),
            "data.path",
            f"{where}: image {shown!r} not found (looked for {path}); "
            "image paths are relative to the data file's folder",
        )
        handle = path
    try:
        with warnings.catch_warnings():
            # PIL warns between its limit and twice it and raises beyond; both are refused here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(handle)
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(
            f"data.path: {where}: image {shown!r} has {_pixels(e)} pixels, more than PIL's limit "
            f"PIL.Image.MAX_IMAGE_PIXELS = {Image.MAX_IMAGE_PIXELS} (a guard against decompression "
            "bombs); downscale the image, or raise PIL.Image.MAX_IMAGE_PIXELS before training if you "
            "trust the file"
        ) from None
    # what PIL's decoders raise for damaged bytes (UnidentifiedImageError is an OSError)
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error, OverflowError) as e:
        raise ValueError(
            f"data.path: {where}: image {shown!r} cannot be read as an image ({type(e).__name__}: "
            f"{e}); give a PNG or JPEG file, or a data:image/...;base64, URL"
        ) from None
    return image


def _pixels(error: Exception) -> str:
    found = re.search(r"\((\d+) pixels\)", str(error))  # PIL names the size only in its message
    return found.group(1) if found else "too many"


def load_images(where: str, sources: List[str], base_dir: str, image_processor) -> Optional[Images]:
    """Read and patch the record's images in order (None for none); processor errors get ``where``."""
    if not sources:
        return None
    images = [open_image(where, s, base_dir) for s in sources]
    try:
        out = image_processor(images, return_tensors="pt")
    except ValueError as e:
        raise ValueError(f"data.path: {where}: {e}") from None
    from ...models.k3_image_processing import image_outputs  # either processor's names (K3's: pixel_values)

    return Images(*image_outputs(out), [tuple(image.size) for image in images])


def expand_placeholders(text: str, tokens_per_image: Sequence[int], placeholder: str = IMAGE_PLACEHOLDER) -> str:
    """Each ``placeholder`` of ``text`` repeated as many times as its image has merged tokens (the first
    placeholders take the first counts: a prefix of the conversation holds the first images)."""
    pieces = text.split(placeholder)
    out = [pieces[0]]
    for count, piece in zip(tokens_per_image, pieces[1:]):
        out.append(placeholder * count + piece)
    return "".join(out)


def record_has_images(record) -> bool:
    """Whether a data record names any image (cheap: no image is read)."""
    if not isinstance(record, dict):
        return False
    if record.get("images"):
        return True
    for message in record.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(i, dict) and i.get("type") in ("image", "image_url") for i in content
        ):
            return True
    return False
