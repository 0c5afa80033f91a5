"""DeepSpeed ZeRO-3 over megatron-core's expert parallelism: experts partitioned within their group.

ZeRO-3 partitions every parameter over its ``ds_process_group``, which it takes from the per-parameter
attribute ``ds_zero_partition_process_group`` when one is set (under ``deepspeed.zero.Init`` and when the engine
partitions a built model). An expert parameter (megatron's mark ``allreduce = False``: the local experts and
their LoRA adapters) exists only on its expert-parallel rank, so it must be partitioned, and its gradient
reduced, only within the expert-data-parallel group: the ranks that hold the same experts. Every other
parameter is partitioned within the whole data-parallel group. ``tag_expert_parameter`` (in
``moe_plugin.megatron.expert_tags``, below this package, since megatron's expert layer tags as it builds) sets the
attributes that make DeepSpeed's ZeRO-3 do that (docs/zero3-ep.md has the source lines and what goes wrong without
them):

* ``ds_zero_partition_process_group``: the expert-data-parallel group;
* ``ds_zero_placement_family = "autoep_expert"``: the gradient is divided by the whole data-parallel size,
  not by the partition group's (megatron's expert scaling: the all-to-all backward has already summed
  every EP rank's tokens into it), and the gradient norm adds the expert-parallel all-reduce, so clipping uses
  one coefficient on every rank;
* ``group_name`` / ``ds_zero_partition_group_name = "ep_size_{EP}"``: the name of DeepSpeed's own expert groups,
  which ``create_deepspeed_expert_groups`` builds and checks equal to megatron's.

The engine's own placement step never runs for a model without DeepSpeed MoE layers, so the tags are the
project's job: ``MegatronStackedExperts`` tags its parameters in its ``__init__`` (so ``zero.Init`` partitions them
right), and the trainer calls ``tag_expert_parameters`` after adding adapters.
"""

from __future__ import annotations

from typing import List

import torch.distributed as dist
from torch import nn

from ..compat.deepspeed import expert_groups
from ..megatron.expert_tags import group_name, tag_expert_parameter
from .grad_reduce import is_expert_parameter

__all__ = ["tag_expert_parameters", "hide_expert_marks", "create_deepspeed_expert_groups"]


def tag_expert_parameters(model: nn.Module) -> int:
    """``tag_expert_parameter`` on every parameter of ``model`` marked ``allreduce = False``; returns the count."""
    params = [p for p in model.parameters() if is_expert_parameter(p)]
    for p in params:
        tag_expert_parameter(p)
    return len(params)


def hide_expert_marks(model: nn.Module) -> None:
    """Remove megatron's expert mark ``allreduce = False`` where no expert group partitions the experts
    (one process, or the Hugging Face face without expert parallelism): DeepSpeed's engine reads the mark as a
    DeepSpeed-MoE parameter and looks for a DeepSpeed-MoE expert group that such a model does not have. With
    every parameter replicated over the data-parallel group there is nothing the mark would change."""
    for p in model.parameters():
        if hasattr(p, "allreduce"):
            del p.allreduce


def _rank_lists(group) -> List[int]:
    return sorted(dist.get_process_group_ranks(group))


def create_deepspeed_expert_groups(ep_size: int) -> None:
    """Build DeepSpeed's expert and expert-data-parallel groups for ``ep_size`` and check that each rank's are
    megatron's (RuntimeError naming the group that differs): ZeRO-3 reduces expert gradients and norms over
    DeepSpeed's groups while the tags partition within megatron's, so they must be the same ranks."""
    from megatron.core import parallel_state

    # DeepSpeed's private group functions (moe_plugin.compat.deepspeed.expert_groups)
    ds_ep, ds_edp = expert_groups(ep_size, group_name(ep_size))
    pairs = (("expert-parallel", ds_ep, parallel_state.get_expert_model_parallel_group()),
             ("expert-data-parallel", ds_edp, parallel_state.get_expert_data_parallel_group()))
    for what, ds_group, mg_group in pairs:
        ours, theirs = _rank_lists(ds_group), _rank_lists(mg_group)
        if ours != theirs:
            raise RuntimeError(f"DeepSpeed's {what} group of rank {dist.get_rank()} is {ours}, megatron's is "
                               f"{theirs}: ZeRO-3 would reduce expert gradients over other ranks than hold them")
