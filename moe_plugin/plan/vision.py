"""The vision tower's share of a micro-batch's activations, read off the model's own encoder run on ``meta``
(docs/planner.md, "The vision tower").

``vision_activation_bytes`` builds ``ImageEncoder`` (tower, 2x2 merge, projector, of the config's kind) on ``meta``
with the recipe's adapters (those of its targets that name vision modules; the seed's ``q_proj``, ``k_proj``,
``gate`` name none, so the tower is frozen whole) and runs it on ``images`` square pictures of ``image_size``
pixels, counted as ``activations._run`` counts a decoder layer: what autograd saves for backward, and the most the
forward holds beyond that and its output. A frozen tower without adapters saves nothing (no parameter or input needs a
gradient): its cost is its working tensors, which come before every decoder layer's, so they add to nothing
else the step holds but the model.

The encoder runs on meta as it is: it reads its grid on the host once (``layers.vision.grid_sides``, from the CPU
tensor given here), and its attention within each image is ``compat.torch.fused_attention``, which counts
what the fused kernel of a CPU or GPU saves (q, k, v, the output and the log-sum-exp, never the [L, L] scores
of SDPA's meta decomposition).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..config import require

__all__ = ["image_grid", "vision_activation_bytes"]


def image_grid(image_size: int, patch_size: int, merge_size: int, kind: str = "vit") -> Tuple[int, int]:
    """The (h, w) patch grid of a square ``image_size`` picture as the base's processor makes it: for the
    ``vit`` tower sides rounded to whole merged patches, as ``models.image_processing`` resizes (at least one
    merged patch); for K3's ``moonvit3d`` the navit resize and padding of ``models.k3_image_processing``."""
    factor = patch_size * merge_size
    if kind == "moonvit3d":
        from ..models.k3_image_processing import K3ImageProcessor, navit_size

        cfg = K3ImageProcessor().media_proc_cfg  # the release's limits
        w, h, pad_w, pad_h, _ = navit_size(
            image_size, image_size, patch_size, merge_size, cfg["in_patch_limit"], cfg["patch_limit_on_one_side"]
        )
        return (h + pad_h) // patch_size, (w + pad_w) // patch_size
    side = max(factor, round(image_size / factor) * factor) // patch_size
    return side, side


def vision_activation_bytes(
    vision_config, lora_section, images: int, image_size: int, dtype: torch.dtype
) -> Tuple[float, float, int]:
    """(saved bytes, working bytes, image tokens) of the vision encoder of ``vision_config`` (a
    ``VisionConfig``) on ``images`` square pictures of ``image_size`` pixels in ``dtype``; image tokens is
    how many placeholders they fill in the text (patches / merge_size^2)."""
    from ..layers.vision_encoder import ImageEncoder
    from .activations import _add_lora
    from .saved_bytes import _run

    require(images >= 0, "--images", f"must be >= 0, got {images}")
    require(image_size > 0, "--image-size", f"must be positive, got {image_size}")
    if images == 0:
        return 0.0, 0.0, 0
    h, w = image_grid(image_size, vision_config.patch_size, vision_config.merge_size, vision_config.kind)
    grid = torch.tensor([[h, w]] * images, dtype=torch.int64)
    with torch.device("meta"):
        encoder = ImageEncoder(vision_config).to(dtype)
    _add_lora(encoder, lora_section)
    patches = torch.empty(images * h * w, vision_config.patch_dim, dtype=dtype, device="meta")
    working: list = []
    saved = _run(lambda: encoder(patches, grid), {encoder: "vision"}, "vision", working)
    return float(sum(saved.values())), float(working[0]), images * h * w // vision_config.merge_size**2
