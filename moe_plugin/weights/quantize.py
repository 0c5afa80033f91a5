"""Exports of packed experts with their LoRA adapters merged (docs/packed-experts.md "Exports").

The default export is the adapter alone: the base experts are quantisation-aware-trained MXFP4 and any
dequantise-requantise round trip is lossy. Merging is a deliberate choice: ``merge_expert_adapter`` returns
the merged experts in BF16 (or any floating dtype), or, with ``requantize=True``, packed again in the base's
format together with the number of weights whose value the requantisation changed from the base (what a
user needs to know before shipping a requantised merge). The export issue calls these per expert stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.quant import decode, encode

__all__ = ["MergedExperts", "merge_expert_adapter"]


@dataclass
class MergedExperts:
    """weight: ``[E, out, in]`` merged floating weights (None when requantised); packed / scale: the requantised
    tensors (None otherwise); changed: weights whose decoded value differs from the base's (requantised only)."""

    weight: Optional[torch.Tensor] = None
    packed: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    changed: Optional[int] = None


@torch.no_grad()
def merge_expert_adapter(
    fmt: str,
    packed: torch.Tensor,
    scale: torch.Tensor,
    in_features: int,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    dtype: torch.dtype = torch.bfloat16,
    requantize: bool = False,
) -> MergedExperts:
    """Merge peft's stacked expert adapter into packed experts.

    packed / scale: ``[E, out, *]`` in ``fmt`` (a layer's storage); lora_a ``[r * E, in]``, lora_b
    ``[out, r * E]`` (peft's layout); ``W_e + scaling * B_e A_e`` computed in fp32. Returns it in ``dtype``, or
    requantised to ``fmt`` with the count of changed values (``requantize``)."""
    e, out = packed.shape[0], packed.shape[1]
    if lora_a.shape[0] % e or lora_a.shape[1] != in_features or tuple(lora_b.shape) != (out, lora_a.shape[0]):
        raise ValueError(
            f"lora_A/lora_B: expected [r * {e}, {in_features}] and [{out}, r * {e}] for these experts, "
            f"got {list(lora_a.shape)} and {list(lora_b.shape)}"
        )
    base = decode(fmt, packed, scale, in_features, torch.float32)
    a = lora_a.float().reshape(e, -1, in_features)
    b = lora_b.float().reshape(out, -1, e).permute(2, 0, 1)
    merged = base + scaling * torch.bmm(b, a)
    if not requantize:
        return MergedExperts(weight=merged.to(dtype))
    new_packed, new_scale = encode(fmt, merged, scale_bits=scale.dtype == torch.uint8)
    changed = int((decode(fmt, new_packed, new_scale, in_features, torch.float32) != base).sum())
    return MergedExperts(packed=new_packed, scale=new_scale, changed=changed)
