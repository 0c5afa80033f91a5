"""The one writer of per-expert packed tensors (docs/packed-experts.md): a stacked packed layer as the published
release stores it. ``testing.packed_checkpoints`` (the tests' packed bases) and ``export.packed`` (a requantised
merged export, layout "k3") both call it, so the two cannot write different tensors.

A layer keeps a stack as ``...experts.w1`` codes ``[E, out, packed_cols]`` and ``...experts.w1_scale``
``[E, out, scale_cols]`` (INT4: the bf16 scale's uint8 bytes, ``ops.quant.formats``). Published, per expert
``e``: ``...experts.{e}.w1.weight_packed`` ``[out, packed_cols]``, ``...weight_scale`` ``[out, groups]`` (MXFP4
uint8 E8M0, INT4 bf16, the same bytes) and, INT4 only, ``...weight_shape`` (the logical ``[out, in]``, int32);
K2 names (``naming="k2"``) as ``weights.packed.packed_expert_name`` gives them.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..ops.quant import check_packed
from .packed import EXPERT_NAMINGS, SCALE_SUFFIX, packed_expert_name, shape_tensor_name

__all__ = ["per_expert_tensors"]


def per_expert_tensors(
    stacked: str, fmt: str, codes: torch.Tensor, scales: torch.Tensor, shape: Sequence[int], naming: str = "k3"
) -> List[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` per expert, in expert order (packed, scale, INT4 shape), of the packed stack ``stacked``
    (``...experts.w1``) of ``fmt`` with logical ``shape`` ``[E, out, in]``: ``codes`` ``[E, out, packed_cols]``,
    ``scales`` ``[E, out, scale_cols]`` as a layer keeps them (INT4 uint8 bytes, or bf16). Every tensor is a copy.
    ValueError naming ``stacked`` for a naming, shape or dtype that is not a ``fmt`` stack, or an MXFP4 NaN scale
    (a checkpoint the loader would refuse)."""
    if naming not in EXPERT_NAMINGS:
        raise ValueError(f"naming: must be one of {EXPERT_NAMINGS}, got {naming!r}")
    experts, out, in_features = (int(n) for n in shape)
    check_packed(stacked, fmt, codes, scales, in_features)
    if tuple(codes.shape[:-1]) != (experts, out):
        raise ValueError(
            f"{stacked}: packed values of a [{experts}, {out}, {in_features}] stack must be "
            f"[{experts}, {out}, ...], got {list(codes.shape)}"
        )
    tensors = []
    for e in range(experts):
        packed_name = packed_expert_name(stacked, e, naming)
        scale = scales[e].clone()
        if fmt == "int4" and scale.dtype == torch.uint8:
            scale = scale.view(torch.bfloat16)  # published as bf16; the layer keeps the bytes
        tensors += [(packed_name, codes[e].clone()), (packed_expert_name(stacked + SCALE_SUFFIX, e, naming), scale)]
        if fmt == "int4":
            tensors.append((shape_tensor_name(packed_name), torch.tensor([out, in_features], dtype=torch.int32)))
    return tensors
