"""LoRA deltas: pure functions, each with a plain reference.

A dense ``nn.Linear`` target has ``lora_A [r, in]``, ``lora_B [out, r]`` and the delta ``scaling * B @ A``
``[out, in]``. A stacked expert target (peft's ``ParamWrapper`` on a 3-D ``[E, out, in]`` expert parameter) has
``lora_A [r * E, in]`` and ``lora_B [out, r * E]`` in the layout of ``moe_plugin.expert_adapters`` (which splits
and stacks them), and expert ``e``'s delta is ``scaling * B_e @ A_e`` (docs/exports.md).
"""

from __future__ import annotations

import torch

from ..config import require
from ..expert_adapters import split_experts_reference, split_factors

__all__ = ["dense_delta", "expert_deltas", "expert_deltas_reference"]


def dense_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """lora_a ``[r, in]``, lora_b ``[out, r]`` -> ``scaling * B @ A`` ``[out, in]`` in fp32."""
    require(
        lora_a.dim() == 2 and lora_b.dim() == 2 and lora_a.shape[0] == lora_b.shape[1],
        "lora",
        f"a dense adapter needs lora_A [r, in] and lora_B [out, r], got {list(lora_a.shape)} and {list(lora_b.shape)}",
    )
    return (lora_b.float() @ lora_a.float()) * scaling


def expert_deltas(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, scaling: float) -> torch.Tensor:
    """Stacked adapters ``[r*E, in]``, ``[out, r*E]`` -> every expert's delta ``[E, out, in]`` (fp32, one einsum)."""
    a, b = split_factors(lora_a.float(), lora_b.float(), experts)  # [E, r, in], [E, out, r]
    return torch.einsum("eor,eri->eoi", b, a) * scaling


def expert_deltas_reference(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, scaling: float) -> torch.Tensor:
    """``expert_deltas`` one expert at a time through ``split_experts_reference`` (the plain reference)."""
    return torch.stack([dense_delta(a, b, scaling) for a, b in split_experts_reference(lora_a, lora_b, experts)])
