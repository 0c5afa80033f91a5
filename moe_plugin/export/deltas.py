"""LoRA deltas and the per-expert split of stacked expert adapters: pure functions, each with a plain reference.

peft stacks one adapter per expert for a 3-D expert parameter ``[E, out, in]`` (this project's experts:
``w1``/``w3`` ``[E, F, L]``, ``w2`` ``[E, L, F]``): ``lora_A`` ``[r * E, in]`` with expert-major rows (expert
``e`` owns rows ``e*r .. e*r + r - 1``) and ``lora_B`` ``[out, r * E]`` with expert-minor columns (expert ``e``
owns columns ``e, e + E, e + 2E, ...``, i.e. ``view(out, r, E)[:, :, e]``). The delta of expert ``e`` is
``scaling * B_e @ A_e`` ``[out, in]`` (docs/exports.md). A dense ``nn.Linear`` target has ``lora_A [r, in]``,
``lora_B [out, r]`` and the delta ``scaling * B @ A``.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from ..config import require

__all__ = ["dense_delta", "expert_deltas", "expert_deltas_reference", "split_experts", "split_experts_reference",
           "stack_experts"]


def dense_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """lora_a ``[r, in]``, lora_b ``[out, r]`` -> ``scaling * B @ A`` ``[out, in]`` in fp32."""
    require(lora_a.dim() == 2 and lora_b.dim() == 2 and lora_a.shape[0] == lora_b.shape[1], "lora",
            f"a dense adapter needs lora_A [r, in] and lora_B [out, r], got {list(lora_a.shape)} and "
            f"{list(lora_b.shape)}")
    return (lora_b.float() @ lora_a.float()) * scaling


def _check_stacked(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> int:
    require(experts > 0 and lora_a.dim() == 2 and lora_b.dim() == 2 and lora_a.shape[0] % experts == 0
            and lora_a.shape[0] == lora_b.shape[1], "lora",
            f"a stacked expert adapter over {experts} experts needs lora_A [r*E, in] and lora_B [out, r*E], got "
            f"{list(lora_a.shape)} and {list(lora_b.shape)}")
    return lora_a.shape[0] // experts


def expert_deltas(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, scaling: float) -> torch.Tensor:
    """Stacked adapters ``[r*E, in]``, ``[out, r*E]`` -> every expert's delta ``[E, out, in]`` (fp32, one einsum)."""
    r = _check_stacked(lora_a, lora_b, experts)
    a = lora_a.float().reshape(experts, r, -1)  # [E, r, in]
    b = lora_b.float().reshape(lora_b.shape[0], r, experts)  # [out, r, E]
    return torch.einsum("ore,eri->eoi", b, a) * scaling


def expert_deltas_reference(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, scaling: float
                            ) -> torch.Tensor:
    """``expert_deltas`` one expert at a time through ``split_experts_reference`` (the plain reference)."""
    return torch.stack([dense_delta(a, b, scaling) for a, b in split_experts_reference(lora_a, lora_b, experts)])


def split_experts(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int
                  ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Stacked adapters -> ``[(A_e [r, in], B_e [out, r])]`` per expert, as contiguous copies (views reshaped)."""
    r = _check_stacked(lora_a, lora_b, experts)
    a = lora_a.reshape(experts, r, -1)
    b = lora_b.reshape(lora_b.shape[0], r, experts).permute(2, 0, 1)  # [E, out, r]
    return [(a[e].contiguous(), b[e].contiguous()) for e in range(experts)]


def split_experts_reference(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int
                            ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``split_experts`` by indexing the rows and columns each expert owns (the layout in the module docstring)."""
    r = _check_stacked(lora_a, lora_b, experts)
    out = []
    for e in range(experts):
        rows = lora_a[e * r:(e + 1) * r]
        cols = lora_b[:, [e + j * experts for j in range(r)]]
        out.append((rows.clone(), cols.clone()))
    return out


def stack_experts(per_expert: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``split_experts``: ``[(A_e [r, in], B_e [out, r])]`` -> (``[r*E, in]``, ``[out, r*E]``)."""
    require(bool(per_expert), "per_expert", "needs at least one expert's adapter")
    a = torch.cat([a for a, _ in per_expert])
    b = torch.stack([b for _, b in per_expert], dim=2)  # [out, r, E]
    return a, b.reshape(b.shape[0], -1)
