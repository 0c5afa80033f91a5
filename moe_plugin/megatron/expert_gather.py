"""The all-gather of routed experts over megatron's expert-parallel group: the one distributed step that turns the
EP ranks' parts (rank ``k`` holds the contiguous experts ``[k*E/EP, (k+1)*E/EP)``) into the whole stack.

It lives beside the megatron model because the group is megatron's (``parallel_state``); the Hugging Face face's
expert parallelism (``parallel.hf_expert_parallel``) sets up the same group and calls it too. What it stitches is
``moe_plugin.expert_adapters``' layout (pure); this module only adds the collective. Every function is collective:
every rank of the expert-parallel group must call it, with tensors of the same shape.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ..expert_adapters import adapter_factor, stitch_experts

__all__ = ["all_gather_expert_parts", "all_gather_expert_stack", "all_gather_expert_adapter", "all_gather_expert"]


def _expert_group():
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()


def all_gather_expert_parts(value: torch.Tensor, group=None) -> List[torch.Tensor]:
    """Every EP rank's ``value`` (same shape on each), in EP-rank order. group: megatron's expert-parallel one
    by default."""
    group = _expert_group() if group is None else group
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    return parts


def all_gather_expert_stack(value: torch.Tensor, group=None) -> torch.Tensor:
    """A base expert stack ``[E_local, ...]`` -> ``[E, ...]`` (the ranks' rows in rank order)."""
    return torch.cat(all_gather_expert_parts(value, group))


def all_gather_expert_adapter(value: torch.Tensor, factor: str, r: int, group=None) -> torch.Tensor:
    """One factor of this rank's rank-``r`` expert adapter (``lora_A [r*E_local, in]`` for factor "A",
    ``lora_B [out, r*E_local]`` for "B") -> the whole ``[r*E, in]`` / ``[out, r*E]`` (``stitch_experts``)."""
    return stitch_experts(all_gather_expert_parts(value, group), factor, r)


def all_gather_expert(name: str, value: torch.Tensor, r: int, group=None) -> torch.Tensor:
    """The value of expert parameter ``name`` made whole: an expert adapter's factor (``adapter_factor(name)``)
    by ``all_gather_expert_adapter`` with LoRA rank ``r``, a base expert stack by ``all_gather_expert_stack``."""
    factor = adapter_factor(name)
    if factor is None:
        return all_gather_expert_stack(value, group)
    return all_gather_expert_adapter(value, factor, r, group)
