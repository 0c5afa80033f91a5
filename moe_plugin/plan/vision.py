"""The vision tower's share of a micro-batch's activations, read off the model's own encoder run on ``meta``
(docs/planner.md, "The vision tower").

``vision_activation_bytes`` builds ``VisionEncoder`` (tower, 2x2 merge, projector) on ``meta`` with the recipe's
adapters (those of its targets that name vision modules; the seed's ``q_proj``, ``k_proj``, ``gate`` name none,
so the tower is frozen whole) and runs it on ``images`` square pictures of ``image_size`` pixels, counted as
``activations._run`` counts a decoder layer: what autograd saves for backward, and the most the forward holds
beyond that and its output. A frozen tower without adapters saves nothing (no parameter or input needs a
gradient): its cost is its working tensors, which come before every decoder layer's, so they add to nothing
else the step holds but the model.

Two stand-ins for the meta run (``_vision_on_meta``): the patch layout decides from values
(``grid_hw.tolist()``), which a meta tensor has none of, so ``layers.vision``'s ``patch_positions`` and
``image_segments`` read the grid from the CPU copy given here; and the attention within each image is counted
as a fused kernel holds it (CPU's and GPU's flash attention, as ``F.scaled_dot_product_attention`` runs on
both: q, k, v, the output and the log-sum-exp, never the [L, L] scores that meta's reference decomposition
would make).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Tuple

import torch

from ..config import require

__all__ = ["image_grid", "vision_activation_bytes"]


def image_grid(image_size: int, patch_size: int, merge_size: int) -> Tuple[int, int]:
    """The (h, w) patch grid of a square ``image_size`` picture: sides rounded to whole merged patches, as
    ``models.image_processing`` resizes (at least one merged patch)."""
    factor = patch_size * merge_size
    side = max(factor, round(image_size / factor) * factor) // patch_size
    return side, side


class _MetaFusedAttention(torch.autograd.Function):
    """The tower's fused attention on meta: q, k ``[B, L, H, D]``, v ``[B, L, H, Dv]`` -> ``[B, L, H, Dv]``,
    saving what a fused kernel saves (q, k, v, the output and the log-sum-exp ``[B, L, H]``)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        lse = q.new_empty(q.shape[:3])
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def _vision_on_meta(grid_cpu: torch.Tensor) -> Iterator[None]:
    from ..layers import vision
    from .meta_ops import _patch

    positions, segments, attend = vision.patch_positions, vision.image_segments, vision._attend

    def on_device(fn):
        # the tower moves grid_hw to the patches' device (meta) before these read its values
        def wrapped(grid_hw, *args):
            out = fn(grid_cpu, *args)
            return (
                out.to(grid_hw.device)
                if isinstance(out, torch.Tensor)
                else [(index.to(grid_hw.device), b, n) for index, b, n in out]
            )

        return wrapped

    def fused_attend(q, k, v):  # [B, L, H, D] each
        return _MetaFusedAttention.apply(q, k, v) if q.is_meta else attend(q, k, v)

    with contextlib.ExitStack() as stack:
        _patch(stack, vision, "patch_positions", on_device(positions))
        _patch(stack, vision, "image_segments", on_device(segments))
        _patch(stack, vision, "_attend", fused_attend)
        yield


def vision_activation_bytes(
    vision_config, lora_section, images: int, image_size: int, dtype: torch.dtype
) -> Tuple[float, float, int]:
    """(saved bytes, working bytes, image tokens) of the vision encoder of ``vision_config`` (a
    ``VisionConfig``) on ``images`` square pictures of ``image_size`` pixels in ``dtype``; image tokens is
    how many placeholders they fill in the text (patches / merge_size^2)."""
    from ..layers.vision import VisionEncoder
    from .activations import _add_lora
    from .saved_bytes import _run

    require(images >= 0, "--images", f"must be >= 0, got {images}")
    require(image_size > 0, "--image-size", f"must be positive, got {image_size}")
    if images == 0:
        return 0.0, 0.0, 0
    h, w = image_grid(image_size, vision_config.patch_size, vision_config.merge_size)
    grid = torch.tensor([[h, w]] * images, dtype=torch.int64)
    with torch.device("meta"):
        encoder = VisionEncoder(vision_config).to(dtype)
    _add_lora(encoder, lora_section)
    patches = torch.empty(images * h * w, vision_config.patch_dim, dtype=dtype, device="meta")
    working: list = []
    with _vision_on_meta(grid):
        saved = _run(lambda: encoder(patches, grid), {encoder: "vision"}, "vision", working)
    return float(sum(saved.values())), float(working[0]), images * h * w // vision_config.merge_size**2
