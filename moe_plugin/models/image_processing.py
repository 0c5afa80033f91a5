"""Offline image processor (Pillow and numpy only; torchvision does not import beside the CPU torch here).

Each image is converted to RGB, resized so that both sides are multiples of ``patch_size * merge_size``
(28 by default) with its pixel count inside [min_pixels, max_pixels] and its aspect ratio kept as closely
as the multiples allow, scaled to [0, 1], normalised per channel, and cut into patches in the layout of
``moe_plugin.layers.vision`` (patch rows ordered by (merged row, merged col, inner row, inner col), each
patch flattened as (C, ph, pw)).
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable, List, Sequence, Tuple, Union

import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature

from ..config import require
from ..fileio import write_json_atomic

CONFIG_NAME = "preprocessor_config.json"
ImageInput = Union[Image.Image, np.ndarray]


class ImageProcessor:
    """images -> ``pixel_patches`` [total_patches, C * P * P] float32 and ``grid_hw`` [num_images, 2] int64."""

    def __init__(
        self,
        patch_size: int = 14,
        merge_size: int = 2,
        min_pixels: int = 56 * 56,
        max_pixels: int = 28 * 28 * 4096,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        max_aspect_ratio: float = 200.0,
    ):
        for name in ("patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = locals()[name]
            require(
                isinstance(value, int) and value > 0,
                f"ImageProcessor.{name}",
                f"must be a positive integer, got {value!r}",
            )
        factor = patch_size * merge_size
        require(
            max_pixels >= factor * factor,
            "ImageProcessor.max_pixels",
            f"must hold at least one merged patch ({factor}x{factor} = {factor * factor}), got {max_pixels}",
        )
        require(
            min_pixels <= max_pixels,
            "ImageProcessor.min_pixels",
            f"must be <= max_pixels ({max_pixels}), got {min_pixels}",
        )
        require(len(image_mean) == 3, "ImageProcessor.image_mean", f"needs 3 (RGB) values, got {image_mean}")
        require(
            len(image_std) == 3 and all(s > 0 for s in image_std),
            "ImageProcessor.image_std",
            f"needs 3 positive (RGB) values, got {image_std}",
        )
        require(max_aspect_ratio >= 1, "ImageProcessor.max_aspect_ratio", f"must be >= 1, got {max_aspect_ratio}")
        self.patch_size = patch_size
        self.merge_size = merge_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.image_mean = [float(m) for m in image_mean]
        self.image_std = [float(s) for s in image_std]
        self.max_aspect_ratio = float(max_aspect_ratio)

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> Tuple[int, int]:
        """Resized (height, width) for an image of the given size (see the module docstring)."""
        if min(height, width) < self.patch_size:
            raise ValueError(
                f"images: an image of {height}x{width} pixels is too small; each side must be "
                f"at least patch_size ({self.patch_size})"
            )
        if max(height, width) / min(height, width) > self.max_aspect_ratio:
            raise ValueError(
                f"images: an image of {height}x{width} pixels exceeds the aspect ratio limit "
                f"max_aspect_ratio ({self.max_aspect_ratio})"
            )
        f = self.factor
        h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h * w > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / scale / f) * f), max(f, math.floor(width / scale / f) * f)
        elif h * w < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * scale / f) * f, math.ceil(width * scale / f) * f
        while h * w > self.max_pixels:  # the one-factor floors above can overshoot on very long images
            if h >= w:
                h -= f
            else:
                w -= f
        return h, w

    def patchify(self, pixels: np.ndarray) -> Tuple[np.ndarray, Tuple[int, int]]:
        """Normalised pixels [C, H, W] (H, W multiples of ``factor``) -> ([gh * gw, C * P * P], (gh, gw))."""
        c, height, width = pixels.shape
        p, m = self.patch_size, self.merge_size
        gh, gw = height // p, width // p
        # axes: channel, merged row, inner row, pixel row, merged col, inner col, pixel col
        grid = pixels.reshape(c, gh // m, m, p, gw // m, m, p)
        patches = grid.transpose(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, c * p * p)
        return np.ascontiguousarray(patches), (gh, gw)

    def preprocess_one(self, image: ImageInput) -> Tuple[np.ndarray, Tuple[int, int]]:
        """One image -> (patches [gh * gw, C * P * P] float32, (gh, gw))."""
        if isinstance(image, np.ndarray):
            if image.ndim != 3 or image.shape[2] not in (3, 4) or image.dtype != np.uint8:
                raise ValueError(f"images: a numpy image must be uint8 [H, W, 3 or 4], got {image.dtype} {image.shape}")
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise ValueError(f"images: expected PIL images or uint8 numpy arrays, got {type(image).__name__}")
        h, w = self.target_size(image.height, image.width)
        image = image.convert("RGB")
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), Image.BICUBIC)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        pixels = ((pixels - mean) / std).transpose(2, 0, 1)
        return self.patchify(pixels)

    def __call__(self, images: Union[ImageInput, Iterable[ImageInput]], return_tensors: str = "pt") -> BatchFeature:
        """One image or a list -> BatchFeature with ``pixel_patches`` [N, C * P * P] and ``grid_hw`` [num_images, 2]."""
        if isinstance(images, (Image.Image, np.ndarray)):
            images = [images]
        images = list(images)
        if not images:
            raise ValueError("images: expected at least one image")
        results = [self.preprocess_one(image) for image in images]
        patches = np.concatenate([r[0] for r in results])
        grid = np.asarray([r[1] for r in results], dtype=np.int64)
        if return_tensors == "pt":
            return BatchFeature({"pixel_patches": torch.from_numpy(patches), "grid_hw": torch.from_numpy(grid)})
        if return_tensors == "np":
            return BatchFeature({"pixel_patches": patches, "grid_hw": grid})
        raise ValueError(f"return_tensors: expected 'pt' or 'np', got {return_tensors!r}")

    def to_dict(self) -> dict:
        return {
            "image_processor_type": type(self).__name__,
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "image_mean": self.image_mean,
            "image_std": self.image_std,
            "max_aspect_ratio": self.max_aspect_ratio,
        }

    def save_pretrained(self, save_directory: str) -> List[str]:
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        write_json_atomic(path, self.to_dict())
        return [path]

    @classmethod
    def from_pretrained(cls, directory: str) -> "ImageProcessor":
        with open(os.path.join(directory, CONFIG_NAME), encoding="utf-8") as f:
            settings = json.load(f)
        settings.pop("image_processor_type", None)
        return cls(**settings)
