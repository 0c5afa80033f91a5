"""K3's image processor rules (its ``preprocessor_config.json``, ``media_proc_cfg``), offline: Pillow and numpy.

For each image (docs/multimodal.md 7):

1. the "navit" resize: ``scale = min(1, sqrt(in_patch_limit / (max(1, w // p) * max(1, h // p))),
   side_limit * p / w, side_limit * p / h)``; the new size is ``max(1, int(side * scale))`` per side, at most
   ``side_limit * p``; the image is resized there (bicubic), aspect ratio kept;
2. a transparent image (one with an alpha band or a transparency key) is composited over the configured
   background after the resize (K3: a chessboard of 16-pixel squares, white 255 at the top left and gray 200);
   any other image is converted to RGB;
3. zeros (black) are padded at the bottom and right up to multiples of ``p * m`` (28): the image has
   ``ceil(h' / 28) * ceil(w' / 28)`` tokens;
4. pixels are scaled to [0, 1] and normalised, ``(x - mean) / std`` (K3: 0.5 and 0.5, so the padding is -1);
5. patches are cut in raster order (row, col), each ``[C, p, p]``.

Outputs: ``pixel_values`` ``[sum of patches, 3, p, p]`` float32 and ``grid_thws`` ``[num_images, 3]`` int64 ((1, h/p,
w/p) per image), the layout of ``moe_plugin.layers.moonvit``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Iterable, List, Mapping, Tuple, Union

import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature

from ..config import require
from ..fileio import write_json_atomic

CONFIG_NAME = "preprocessor_config.json"
ImageInput = Union[Image.Image, np.ndarray]
# media_proc_cfg key -> the default the release's processor uses when it is absent
_DEFAULTS: Dict[str, Any] = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 65536,
    "in_patch_limit_each_frame": 16384,  # video frames: kept for the round trip, images never read it
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "transparent_bg_config": {"pattern": "chessboard"},
    "transparent_bg_fill_stage": "after_resize",
}
_BACKGROUND = {  # transparent_bg_config's keys and their defaults (the release's)
    "pattern": "black",
    "chessboard_square_size": 16,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 200,
}
_PATTERNS = ("white", "black", "gray", "chessboard")


def navit_size(width: int, height: int, patch: int, merge: int, in_patch_limit: int, side_limit: int):
    """(new_width, new_height, pad_width, pad_height, tokens) of K3's navit resize (steps 1 and 3 above)."""
    s1 = math.sqrt(in_patch_limit / (max(1.0, width // patch) * max(1.0, height // patch)))
    scale = min(1.0, s1, side_limit * patch / width, side_limit * patch / height)
    new_w = min(max(1, int(width * scale)), side_limit * patch)
    new_h = min(max(1, int(height * scale)), side_limit * patch)
    factor = merge * patch
    pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    return new_w, new_h, pad_w, pad_h, ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)


class K3ImageProcessor:
    """images -> ``pixel_values`` ``[N, 3, p, p]`` and ``grid_thws`` ``[num_images, 3]`` by K3's rules."""

    def __init__(self, media_proc_cfg: Mapping[str, Any] = None):
        cfg = dict(media_proc_cfg or {})
        unknown = sorted(set(cfg) - set(_DEFAULTS))
        where = f"media_proc_cfg.{unknown[0]}" if unknown else "media_proc_cfg"
        known = sorted(_DEFAULTS)
        require(not unknown, where, f"not a key of K3's image processor (unknown: {unknown}; known: {known})")
        cfg = {**_DEFAULTS, **cfg}
        for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            value = cfg[key]
            require(
                isinstance(value, int) and value > 0, f"media_proc_cfg.{key}", f"must be a positive int, got {value!r}"
            )
        require(
            cfg["fixed_output_tokens"] is None,
            "media_proc_cfg.fixed_output_tokens",
            f"only null (the token count follows the image) is supported, got {cfg['fixed_output_tokens']!r}",
        )
        require(
            cfg["transparent_bg_fill_stage"] == "after_resize",
            "media_proc_cfg.transparent_bg_fill_stage",
            f"only 'after_resize' (K3's) is supported, got {cfg['transparent_bg_fill_stage']!r}",
        )
        for key in ("image_mean", "image_std"):
            require(len(cfg[key]) == 3, f"media_proc_cfg.{key}", f"needs 3 (RGB) values, got {cfg[key]!r}")
        require(all(s > 0 for s in cfg["image_std"]), "media_proc_cfg.image_std", "must be positive")
        background = cfg["transparent_bg_config"]
        if background is not None:
            bad = sorted(set(background) - set(_BACKGROUND))
            require(
                not bad, "media_proc_cfg.transparent_bg_config", f"unknown keys {bad}; known: {sorted(_BACKGROUND)}"
            )
            background = {**_BACKGROUND, **background}
            require(
                background["pattern"] in _PATTERNS,
                "media_proc_cfg.transparent_bg_config.pattern",
                f"must be one of {_PATTERNS}, got {background['pattern']!r}",
            )
        self.media_proc_cfg = cfg
        self.background = background
        self.patch_size = cfg["patch_size"]
        self.merge_size = cfg["merge_kernel_size"]

    def resize_config(self, width: int, height: int) -> Tuple[int, int, int, int, int]:
        """(new_width, new_height, pad_width, pad_height, tokens) for an image of ``width`` x ``height``."""
        cfg = self.media_proc_cfg
        return navit_size(
            width, height, self.patch_size, self.merge_size, cfg["in_patch_limit"], cfg["patch_limit_on_one_side"]
        )

    def num_tokens(self, image: Image.Image) -> int:
        """The image's token count: ``ceil(h' / 28) * ceil(w' / 28)`` after the navit resize."""
        return self.resize_config(image.width, image.height)[4]

    def _background(self, height: int, width: int) -> np.ndarray:
        bg = self.background
        if bg["pattern"] != "chessboard":
            return np.full((height, width, 3), {"white": 255, "black": 0, "gray": 128}[bg["pattern"]], np.uint8)
        size = bg["chessboard_square_size"]
        ys, xs = np.arange(height)[:, None] // size, np.arange(width)[None, :] // size
        gray = (ys + xs) % 2 == (1 if bg["chessboard_square_on_top_left"] else 0)
        out = np.where(gray, bg["chessboard_gray_value"], bg["chessboard_white_value"]).astype(np.uint8)
        return np.repeat(out[:, :, None], 3, axis=2)

    def _rgb(self, image: Image.Image) -> np.ndarray:
        """[H, W, 3] uint8: transparent pixels over the background (step 2)."""
        if image.mode == "RGB" or self.background is None:
            return np.asarray(image.convert("RGB"))
        if "A" not in image.getbands() and "transparency" not in image.info:
            return np.asarray(image.convert("RGB"))
        rgba = np.asarray(image.convert("RGBA"))
        alpha = (rgba[:, :, 3].astype(np.float32) / 255.0)[:, :, None]
        bg = self._background(*rgba.shape[:2])
        return (alpha * rgba[:, :, :3] + (1 - alpha) * bg).astype(np.uint8)

    def preprocess_one(self, image: ImageInput) -> Tuple[np.ndarray, Tuple[int, int, int]]:
        """One image -> (patches ``[h * w, 3, p, p]`` float32, (1, h, w))."""
        if isinstance(image, np.ndarray):
            if image.ndim != 3 or image.shape[2] not in (3, 4) or image.dtype != np.uint8:
                raise ValueError(f"images: a numpy image must be uint8 [H, W, 3 or 4], got {image.dtype} {image.shape}")
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise ValueError(f"images: expected PIL images or uint8 numpy arrays, got {type(image).__name__}")
        new_w, new_h, pad_w, pad_h, _ = self.resize_config(image.width, image.height)
        pixels = self._rgb(image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
        pixels = np.pad(pixels, ((0, pad_h), (0, pad_w), (0, 0)))
        mean = np.asarray(self.media_proc_cfg["image_mean"])
        std_inv = 1.0 / np.asarray(self.media_proc_cfg["image_std"])
        x = (pixels / 255.0).astype(np.float32)
        x -= mean  # in place: rounded to float32 after each step, as the release's normalise does
        x *= std_inv
        p = self.patch_size
        h, w = x.shape[0] // p, x.shape[1] // p
        patches = x.reshape(h, p, w, p, 3).transpose(0, 2, 4, 1, 3).reshape(h * w, 3, p, p)
        return np.ascontiguousarray(patches), (1, h, w)

    def __call__(self, images: Union[ImageInput, Iterable[ImageInput]], return_tensors: str = "pt") -> BatchFeature:
        """One image or a list -> BatchFeature with ``pixel_values`` and ``grid_thws``."""
        if isinstance(images, (Image.Image, np.ndarray)):
            images = [images]
        images = list(images)
        if not images:
            raise ValueError("images: expected at least one image")
        results = [self.preprocess_one(image) for image in images]
        pixels = np.concatenate([r[0] for r in results])
        grid = np.asarray([r[1] for r in results], dtype=np.int64)
        if return_tensors == "pt":
            return BatchFeature({"pixel_values": torch.from_numpy(pixels), "grid_thws": torch.from_numpy(grid)})
        if return_tensors == "np":
            return BatchFeature({"pixel_values": pixels, "grid_thws": grid})
        raise ValueError(f"return_tensors: expected 'pt' or 'np', got {return_tensors!r}")

    def to_dict(self) -> dict:
        return {"image_processor_type": "KimiK3VisionProcessor", "media_proc_cfg": dict(self.media_proc_cfg)}

    def save_pretrained(self, save_directory: str) -> List[str]:
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        write_json_atomic(path, self.to_dict())
        return [path]

    @classmethod
    def from_pretrained(cls, directory: str) -> "K3ImageProcessor":
        with open(os.path.join(directory, CONFIG_NAME), encoding="utf-8") as f:
            return cls(json.load(f)["media_proc_cfg"])


def load_image_processor(directory: str):
    """The image processor a base's ``preprocessor_config.json`` describes: K3's (it has ``media_proc_cfg``) or
    this project's ``ImageProcessor``."""
    from .image_processing import ImageProcessor

    with open(os.path.join(directory, CONFIG_NAME), encoding="utf-8") as f:
        settings = json.load(f)
    return (
        K3ImageProcessor(settings["media_proc_cfg"])
        if "media_proc_cfg" in settings
        else ImageProcessor.from_pretrained(directory)
    )


def image_outputs(out: Mapping[str, Any]) -> Tuple[Any, Any]:
    """(pixels, grid) of either processor's output: K3's ``pixel_values`` / ``grid_thws`` or this project's
    ``pixel_patches`` / ``grid_hw``."""
    if "pixel_values" in out:
        return out["pixel_values"], out["grid_thws"]
    return out["pixel_patches"], out["grid_hw"]
