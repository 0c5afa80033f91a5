"""The stacked expert-adapter layout, in one place: split, stack, slice and stitch, each beside a plain reference.

peft's ``ParamWrapper`` (``target_parameters``) adapts a 3-D expert parameter ``[E, out, in]`` (this project's
experts: ``w1``/``w3`` ``[E, F, L]``, ``w2`` ``[E, L, F]``) with one rank-``r`` adapter per expert, stacked:

* ``lora_A`` ``[r * E, in]``, expert-major rows: expert ``e`` owns rows ``e*r .. e*r + r - 1``
  (``view(E, r, in)[e]``);
* ``lora_B`` ``[out, r * E]``, expert-minor columns: expert ``e`` owns columns ``e, e + E, e + 2E, ...``
  (``view(out, r, E)[:, :, e]``).

The delta of expert ``e`` is ``scaling * B_e @ A_e`` ``[out, in]`` (docs/exports.md). An expert-parallel rank holds
the contiguous experts ``[first, last)`` of every MoE layer (``experts_held``, the rule ``ParallelLayout`` owns),
so its local adapters are the same layout over
``E_local = last - first`` experts; ``slice_experts`` cuts a rank's part out of the whole and ``stitch_experts``
puts the ranks' parts back together (the all-gather that feeds it is ``megatron.expert_gather``, distributed code).

Every function here is pure (torch only). The fast ones reshape; the ``_reference`` ones index the rows and columns
the layout above names, one expert at a time, and the tests hold the two equal.
"""

from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

import torch

from .config import require

__all__ = [
    "experts_held",
    "adapter_factor",
    "split_factors",
    "split_experts",
    "split_experts_reference",
    "stack_experts",
    "stack_experts_reference",
    "slice_experts",
    "slice_experts_reference",
    "stitch_experts",
    "stitch_experts_reference",
]

# an expert adapter's parameter name, on both faces: "...experts.w1.lora_A.default.weight" (Hugging Face),
# "...experts.base_layer.lora_B.default.weight" (nested wrappers)
_EXPERT_ADAPTER = re.compile(r"(?:^|\.)experts\.(?:base_layer\.)*lora_([AB])\.")


def experts_held(num_experts: int, expert: int, ep_rank: int) -> Tuple[int, int]:
    """The one rule for which routed experts an expert-parallel rank holds: ``[first, last)``, the contiguous
    ``E / expert`` experts from ``ep_rank x E / expert`` (megatron-core's ``local_expert_indices``, DeepSpeed's
    and the checkpoints' expert-parallel slices agree). ValueError naming the size that does not divide."""
    require(
        num_experts % expert == 0,
        "parallel.expert_parallel_size",
        f"must divide the number of routed experts ({num_experts}), got {expert}",
    )
    require(0 <= ep_rank < expert, "ep_rank", f"must be in [0, {expert}), got {ep_rank}")
    local = num_experts // expert
    return ep_rank * local, (ep_rank + 1) * local


def adapter_factor(name: str) -> Optional[str]:
    """``"A"`` or ``"B"`` for the name of a routed-expert adapter tensor (``...experts...lora_A.<adapter>...``),
    None for any other tensor (a dense adapter, a base weight)."""
    m = _EXPERT_ADAPTER.search(name)
    return m.group(1) if m else None


def _check_stacked(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> int:
    require(
        experts > 0
        and lora_a.dim() == 2
        and lora_b.dim() == 2
        and lora_a.shape[0] % experts == 0
        and lora_a.shape[0] == lora_b.shape[1],
        "lora",
        f"a stacked expert adapter over {experts} experts needs lora_A [r*E, in] and lora_B [out, r*E], got "
        f"{list(lora_a.shape)} and {list(lora_b.shape)}",
    )
    return lora_a.shape[0] // experts


def _check_factor(factor: str) -> None:
    require(factor in ("A", "B"), "factor", f"must be 'A' (lora_A) or 'B' (lora_B), got {factor!r}")


def split_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """lora_a ``[r*E, in]``, lora_b ``[out, r*E]`` -> ``(A [E, r, in], B [E, out, r])``, views (no copy, autograd
    flows through: the packed forward and the export's one-einsum deltas use it)."""
    r = _check_stacked(lora_a, lora_b, experts)
    a = lora_a.reshape(experts, r, lora_a.shape[1])
    b = lora_b.reshape(lora_b.shape[0], r, experts).permute(2, 0, 1)
    return a, b


def split_experts(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """lora_a ``[r*E, in]``, lora_b ``[out, r*E]`` -> ``[(A_e [r, in], B_e [out, r]) for e in range(E)]``, each a
    contiguous copy (``split_factors`` indexed per expert)."""
    a, b = split_factors(lora_a, lora_b, experts)
    return [(a[e].contiguous(), b[e].contiguous()) for e in range(experts)]


def split_experts_reference(
    lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``split_experts`` by indexing the rows and columns each expert owns (the layout in the module docstring)."""
    r = _check_stacked(lora_a, lora_b, experts)
    out = []
    for e in range(experts):
        rows = lora_a[e * r : (e + 1) * r]
        cols = lora_b[:, [e + j * experts for j in range(r)]]
        out.append((rows.clone(), cols.clone()))
    return out


def stack_experts(per_expert: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``split_experts``: ``[(A_e [r, in], B_e [out, r])]`` over E experts -> (``lora_A [r*E, in]``,
    ``lora_B [out, r*E]``)."""
    require(bool(per_expert), "per_expert", "needs at least one expert's adapter")
    a = torch.cat([a for a, _ in per_expert])
    b = torch.stack([b for _, b in per_expert], dim=2)  # [out, r, E]
    return a, b.reshape(b.shape[0], -1)


def stack_experts_reference(
    per_expert: Sequence[Tuple[torch.Tensor, torch.Tensor]],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``stack_experts`` by writing each expert's rows and columns into zeros, one expert at a time."""
    require(bool(per_expert), "per_expert", "needs at least one expert's adapter")
    experts, (a0, b0) = len(per_expert), per_expert[0]
    r = a0.shape[0]
    a = a0.new_zeros(r * experts, a0.shape[1])
    b = b0.new_zeros(b0.shape[0], r * experts)
    for e, (a_e, b_e) in enumerate(per_expert):
        a[e * r : (e + 1) * r] = a_e
        for j in range(r):
            b[:, e + j * experts] = b_e[:, j]
    return a, b


def slice_experts(value: torch.Tensor, factor: str, first: int, last: int, experts: int) -> torch.Tensor:
    """The experts ``[first, last)`` of one factor of a whole stacked adapter over ``experts`` experts:
    ``lora_A [r*E, in]`` -> ``[r*(last-first), in]`` (factor "A"), ``lora_B [out, r*E]`` -> ``[out, r*(last-first)]``
    (factor "B"), in the same layout over ``last - first`` experts (what an EP rank holding them has)."""
    _check_factor(factor)
    require(
        0 <= first < last <= experts and value.dim() == 2 and value.shape[0 if factor == "A" else 1] % experts == 0,
        "value",
        f"experts [{first}, {last}) of a lora_{factor} {list(value.shape)} over {experts} experts "
        "do not fit the stacked layout",
    )
    if factor == "A":
        r = value.shape[0] // experts
        return value[first * r : last * r]
    out = value.shape[0]
    return value.reshape(out, -1, experts)[:, :, first:last].reshape(out, -1)


def slice_experts_reference(value: torch.Tensor, factor: str, first: int, last: int, experts: int) -> torch.Tensor:
    """``slice_experts`` by picking each kept expert's rows (A) or columns (B) one at a time into a new stacking."""
    _check_factor(factor)
    r = value.shape[0 if factor == "A" else 1] // experts
    local = last - first
    if factor == "A":
        return torch.cat([value[e * r : (e + 1) * r] for e in range(first, last)])
    cols = [None] * (r * local)
    for j, e in enumerate(range(first, last)):
        for i in range(r):
            cols[j + i * local] = value[:, e + i * experts]
    return torch.stack(cols, dim=1)


def stitch_experts(parts: Sequence[torch.Tensor], factor: str, r: int) -> torch.Tensor:
    """The whole stacking of one factor of a rank-``r`` expert adapter from the EP ranks' parts, in EP-rank order
    (rank ``k`` holding the next ``E_k`` experts): lora_A parts ``[r*E_k, in]`` -> ``[r*E, in]`` (factor "A"), lora_B
    parts ``[out, r*E_k]`` -> ``[out, r*E]`` (factor "B"), ``E = sum(E_k)``. Inverse of ``slice_experts``."""
    _check_factor(factor)
    require(bool(parts) and r > 0, "parts", f"needs at least one rank's part and r > 0, got {len(parts)} and r={r}")
    if factor == "A":
        return torch.cat(list(parts))
    out = parts[0].shape[0]
    return torch.cat([p.reshape(out, r, -1) for p in parts], dim=2).reshape(out, -1)


def stitch_experts_reference(parts: Sequence[torch.Tensor], factor: str, r: int) -> torch.Tensor:
    """``stitch_experts`` one expert at a time: each part's experts (rows for A, columns ``j + i*E_k`` for B) in
    rank order, written at their global places."""
    _check_factor(factor)
    if factor == "A":
        return torch.cat([p[j * r : (j + 1) * r] for p in parts for j in range(p.shape[0] // r)])
    locals_ = [p.shape[1] // r for p in parts]
    experts = sum(locals_)
    out = parts[0].new_zeros(parts[0].shape[0], r * experts)
    e = 0
    for p, local in zip(parts, locals_):
        for j in range(local):
            for i in range(r):
                out[:, e + i * experts] = p[:, j + i * local]
            e += 1
    return out
